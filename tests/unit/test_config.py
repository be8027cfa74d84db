"""Every config group option composes against the typed schema; nothing is launched."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ddp_lab.config import register_configs
from ddp_lab.launcher.config_checks import ConfigError, validate
from ddp_lab.models.facts import parameter_counts
from ddp_lab.spec.labels import knob_label
from tests.helpers.extras import installed

CONF = Path(__file__).resolve().parents[2] / "conf"
register_configs()


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("strategy", _options("strategy"))
def test_every_strategy_composes_and_names_itself(strategy):
    cfg = _compose(f"strategy={strategy}")
    assert cfg.strategy.name == strategy  # results and W&B runs say which strategy they measured
    if installed(strategy):
        validate(cfg)
    else:  # an optional extra this install lacks: refused in one line, naming the install
        with pytest.raises(ConfigError, match="which is not installed"):
            validate(cfg)


@pytest.mark.parametrize("overrides, label", [
    (["strategy=bucketed", "strategy.bucket_mb=10"], "bucketed-bucket_mb=10.0"),
    (["strategy=zero1"], "zero1-bucket_mb=25.0-grad_sync=bucketed-comm=allreduce_broadcast"),
    (["strategy=zero1", "strategy.comm=reduce_scatter"], "zero1-comm=reduce_scatter"),  # no wrapper, no buckets
    (["strategy=flat"], "flat"),
])
def test_run_names_carry_the_knobs_in_use(overrides, label):
    assert knob_label(_compose(*overrides).strategy) == label


@pytest.mark.parametrize("overrides, name", [
    (["strategy=flat"], "flat-tiny-ws2"),
    (["strategy=flat", "data=text"], "flat-data=text-tiny-ws2"),
    (["strategy=flat", "data=tokens", "data.path=/data/owt/train.bin"], "flat-data=tokens(train.bin)-tiny-ws2"),
])
def test_run_names_say_the_data_unless_synthetic(overrides, name):
    """Rows of a sweep over data sources or token files tell apart (spec/labels.py)."""
    from ddp_lab.spec.labels import run_name

    assert run_name(OmegaConf.to_container(_compose(*overrides), resolve=True)) == name


@pytest.mark.parametrize("model", ["toy", "tiny", "small"])
def test_small_models_fit_and_validate(model):
    validate(_compose(f"model={model}"))


# CS336 assignment 2, Table 1: d_model, d_ff, layers, heads; vocab 10000.
TABLE_1 = {"small": (768, 3072, 12, 12), "medium": (1024, 4096, 24, 16), "large": (1280, 5120, 36, 20),
           "xl": (1600, 6400, 48, 25), "2.7b": (2560, 10240, 32, 32)}


@pytest.mark.parametrize("size", list(TABLE_1))
def test_table_1_sizes(size):
    m = _compose(f"model={size}").model
    assert (m.d_model, m.d_ff, m.num_layers, m.num_heads, m.vocab_size) == (*TABLE_1[size], 10000)


def test_parameter_count_of_small_by_hand():
    # per layer: qkv+proj 4*d^2, SwiGLU 3*d*d_ff, two RMSNorm weights 2*d; plus embed, lm_head, final norm
    d, ff, layers, vocab = 768, 3072, 12, 10000
    expected = layers * (4 * d * d + 3 * d * ff + 2 * d) + 2 * vocab * d + d
    assert parameter_counts(_compose("model=small").model)["total"] == expected


def test_memory_check_refuses_xl_on_four_cpu_ranks():
    with pytest.raises(ConfigError, match="needs about"):
        validate(_compose("model=xl", "world_size=4", "backend=gloo"))


def test_default_experiment_is_two_gloo_ranks_on_tiny():
    cfg = _compose()
    assert (cfg.world_size, cfg.model.name, cfg.backend.name, cfg.logger.mode) == (2, "tiny", "auto", "offline")


@pytest.mark.parametrize("args, expected", [
    (["strategy=hsdp,fsdp_torch", "strategy.shard_size=2", "-m"], "strategy.shard_size=choice(2)"),
    (["strategy=hsdp,fsdp_torch", "strategy.shard_size=2,4", "-m"], "strategy.shard_size=2,4"),  # a sweep already
    (["strategy=hsdp", "strategy.shard_size=2", "-m"], "strategy.shard_size=2"),      # the group is not swept
    (["strategy=hsdp,fsdp", "strategy.shard_size=2"], "strategy.shard_size=2"),       # not a multirun
    (["data=text,tokens", "data.path=/d/train_*.bin", "-m"], "data.path=choice(/d/train_*.bin)"),
    (["strategy=a,b", "strategy.x='a b'", "-m"], "strategy.x='a b'"),                 # quoted: left alone
])
def test_a_knob_of_swept_group_options_becomes_a_sweep_of_one_value(args, expected):
    """Hydra's multirun composes its base config at the group's default option, which may lack the knob."""
    from ddp_lab.launcher.preflight import knobs_of_swept_groups

    assert expected in knobs_of_swept_groups(args)


def test_the_gloo_rings_are_refused_on_nccl(monkeypatch):
    """backend.collectives=ring is the lab's rings for gloo; on nccl (GPUs pretended here) it is refused in one
    line, before anything looks for a GPU."""
    import ddp_lab.machine

    monkeypatch.setattr(ddp_lab.machine, "cuda_devices", lambda: 8)  # config_checks imports it where it asks
    with pytest.raises(ConfigError, match="backend.collectives=ring is the lab's rings for gloo"):
        validate(_compose("backend=nccl", "backend.collectives=ring"))
    validate(_compose("backend=gloo", "backend.collectives=ring"))


@pytest.mark.parametrize("overrides, name", [
    (["strategy=zero2"], "zero2-bucket_mb=25.0-tiny-ws2"),
    (["strategy=zero2", "backend.collectives=ring"], "zero2-bucket_mb=25.0-tiny-ws2"),  # gloo's default
    (["strategy=zero2", "backend.collectives=native"], "zero2-bucket_mb=25.0-collectives=native-tiny-ws2"),
    (["task=allreduce", "task.op=reduce_scatter", "backend=gloo", "backend.collectives=native"],
     "reduce_scatter-10.0MiB-gloo-collectives=native-ws2"),
])
def test_run_names_say_when_the_backends_own_collectives_ran(overrides, name):
    from ddp_lab.spec.labels import run_name

    assert run_name(OmegaConf.to_container(_compose(*overrides), resolve=True)) == name
