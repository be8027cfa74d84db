"""The launcher's model facts come from shapes at a bounded cost (ddp_lab/models/facts.py): counted at small
sizes and scaled to the size asked for. The scaling is held here to real measurements at two sizes, on the CPU
(the small models) and on the meta device (a model too large to run for real there)."""

import pytest
from omegaconf import OmegaConf

from ddp_lab.analysis.calculator import load_model_config
from ddp_lab.models.facts import (
    MEASURED_CONTEXTS,
    MEASURED_DEPTHS,
    _activation_bytes,
    _counts_of,
    _key,
    activation_bytes,
    bounded_size,
    meta_model,
    parameter_counts,
)


def _sized(name, **changes):
    return OmegaConf.merge(load_model_config(name), changes)


@pytest.mark.parametrize("changes", [{"context_length": 200, "num_layers": 5},
                                     {"context_length": 384, "num_layers": 7}])
def test_scaled_activations_equal_a_real_forward_at_the_size(changes):
    """tiny deeper and longer than the measured sizes: the scaled count equals a real CPU forward's, to the byte."""
    cfg = _sized("tiny", **changes)
    assert changes["context_length"] > MEASURED_CONTEXTS[-1] and changes["num_layers"] > MEASURED_DEPTHS[-1]
    assert activation_bytes(cfg, 1) == _activation_bytes(_key(cfg), 1, "cpu")
    assert activation_bytes(cfg, 3) == 3 * _activation_bytes(_key(cfg), 1, "cpu")


@pytest.mark.parametrize("context", [256, 512])
def test_scaled_activations_equal_the_meta_devices_for_a_large_model(context):
    """xl at 2.7b's widths is measured on the meta device, whose attention saves the score matrix: the quadratic
    fit through the measured contexts is exact there too."""
    cfg = _sized("2.7b", context_length=context, num_layers=4)
    assert activation_bytes(cfg, 1) == _activation_bytes(_key(cfg), 1, "meta")


@pytest.mark.parametrize("name, changes", [("tiny", {"num_layers": 9}), ("small", {}), ("xl", {}),
                                           ("tiny", {"num_layers": 5, "context_length": 1000})])
def test_scaled_parameter_counts_equal_the_built_model(name, changes):
    cfg = _sized(name, **changes)
    assert parameter_counts(cfg) == _counts_of(meta_model(cfg))


def test_a_learned_position_table_scales_with_the_context():
    """examples/tied_gpt learns a position per token: its count grows with the context, and the scaling sees it."""
    cfg = OmegaConf.merge(OmegaConf.load("examples/conf/model/tied_gpt.yaml"), {"context_length": 300, "num_layers": 5})
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "defaults"])
    assert parameter_counts(cfg) == _counts_of(meta_model(cfg))


def test_the_bounded_size_keeps_the_kinds_of_layers():
    cfg = _sized("xl", context_length=10**9, num_layers=10**6)
    small = bounded_size(cfg)
    assert small.num_layers == MEASURED_DEPTHS[-1] and small.context_length == MEASURED_CONTEXTS[-1]
    kinds = {type(m).__name__ for m in meta_model(small).modules()}
    assert kinds == {type(m).__name__ for m in meta_model(load_model_config("tiny")).modules()}
