"""Precision and comm_dtype knobs before launch: what composes, and each refusal's one line."""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import ddp_lab.machine
from ddp_lab.config import register_configs
from ddp_lab.launcher.config_checks import ConfigError, validate
from ddp_lab.spec.choices import Dtype
from ddp_lab.spec.strategy import StrategySpec

CONF = Path(__file__).resolve().parents[2] / "conf"
register_configs()
REDUCING = ["naive", "flat", "overlap", "bucketed", "zero1", "zero2", "torch_ddp", "zero1_torch", "powersgd", "fsdp",
            "fsdp_torch"]


@dataclass
class ParameterAveragingSpec(StrategySpec):
    """A strategy with no gradient collective (as local_sgd) that still declares a comm_dtype knob."""

    _target_: str = f"{__name__}.ParameterAveragingSpec"
    name: str = "parameter_averaging"
    comm_dtype: Optional[Dtype] = None

    runtime = "ddp_lab.strategies.LocalSGD"
    reduces_gradients = False


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=["backend=gloo", *overrides])


@pytest.mark.parametrize("strategy", REDUCING)
def test_comm_dtype_is_a_knob_of_every_reducing_strategy(strategy):
    validate(_compose(f"strategy={strategy}", "strategy.comm_dtype=fp16"))


@pytest.mark.parametrize("strategy", ["bucketed", "zero2", "powersgd", "fsdp", "fsdp_torch"])
def test_bf16_on_the_wire_for_hand_written_strategies_on_gloo(strategy):
    validate(_compose(f"strategy={strategy}", "strategy.comm_dtype=bf16"))


@pytest.mark.parametrize("overrides", [["strategy=torch_ddp"], ["strategy=zero1_torch"],
                                       ["strategy=zero1", "strategy.grad_sync=torch_ddp"]])
def test_bf16_through_torch_hooks_on_gloo_is_refused(overrides):
    with pytest.raises(ConfigError, match="bf16_compress_hook, which torch allows only on CUDA with NCCL"):
        validate(_compose(*overrides, "strategy.comm_dtype=bf16"))


def test_comm_dtype_on_a_strategy_without_gradient_collective_is_refused():
    cfg = _compose()
    cfg.strategy = OmegaConf.structured(ParameterAveragingSpec(comm_dtype="bf16"))
    with pytest.raises(ConfigError, match="strategy.comm_dtype does not apply to strategy=parameter_averaging"):
        validate(cfg)
    cfg.strategy.comm_dtype = None
    validate(cfg)


@pytest.mark.parametrize("key", ["strategy.comm_dtype", "train.precision"])
def test_unknown_dtypes_are_refused_by_the_schema(key):
    with pytest.raises(ConfigCompositionException):
        _compose("strategy=bucketed", f"{key}=fp8")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_precision_runs_for_every_strategy(precision):
    for strategy in REDUCING:  # grad_error too, except where ZeRO-3 refuses it (its own test)
        grad_error = "measure.grad_error=false" if strategy.startswith("fsdp") else "measure.grad_error=true"
        validate(_compose(f"strategy={strategy}", f"train.precision={precision}", grad_error))


def test_precision_the_device_cannot_do_is_refused(monkeypatch):
    monkeypatch.setattr(ddp_lab.machine, "precision_problem",  # config_checks imports it where it asks
                        lambda precision, device_type: f"autocast to {precision} does not run on {device_type}")
    with pytest.raises(ConfigError, match="train.precision=fp16: autocast to fp16 does not run on cpu"):
        validate(_compose("train.precision=fp16"))


def test_grad_error_on_a_strategy_that_shards_parameters_is_refused():
    with pytest.raises(ConfigError, match="measure.grad_error: strategy=fsdp shards the parameters themselves"):
        validate(_compose("strategy=fsdp", "measure.grad_error=true"))
