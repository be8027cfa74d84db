"""`measure.grad_error` on a mesh: the probe's exact gradient is averaged as the strategy averages it, over each
parameter's replicas (the data-parallel ranks, dp x cp; an expert's copies, divided by dp x cp), never over the
tensor-parallel or pipeline ranks, whose pieces differ (rank/grad_error.py, `Parallelism.averaging()`).

An exact strategy (bucketed) then measures 0 to float32 rounding on every layout, as on one process
(tests/parity/test_precision.py), where the probe that averaged over every rank mixed different pieces together; a
strategy that synchronizes nothing measures each rank's distance from the average, the same on a mesh as on the
data-parallel ranks alone."""

from __future__ import annotations

import pytest

from ddp_lab.check.parity import train_on_mesh
from tests.helpers.distributed import ranks_fixture
from tests.helpers.moe import tiny_moe

EXACT_CASES = {
    "tp 2": ("transformer", dict(tp=2)),
    "tp 2 torch sequence parallel": ("transformer", dict(tp=2, impl="torch", sequence_parallel=True)),
    "pp 2": ("transformer", dict(pipeline={"pp": 2, "microbatches": 2})),
    "pp 2 gpipe": ("transformer", dict(pipeline={"pp": 2, "microbatches": 2, "pp_schedule": "gpipe"})),
    "pp 2 interleaved": ("deep_transformer", dict(pipeline={"pp": 2, "microbatches": 2, "stages_per_rank": 2,
                                                            "pp_schedule": "interleaved_1f1b"})),
    "cp 2": ("transformer", dict(context={"cp": 2, "cp_impl": "zigzag"})),
    "cp 2 ring": ("transformer", dict(context={"cp": 2, "cp_impl": "ring"})),
    "cp 2 ulysses": ("transformer", dict(context={"cp": 2, "cp_impl": "ulysses"})),
    "cp 2 torch": ("transformer", dict(context={"cp": 2, "cp_impl": "torch"})),
    "cp 4 hybrid": ("transformer", dict(context={"cp": 4, "cp_impl": "hybrid", "cp_ulysses": 2})),
    "ep 2": (tiny_moe(), dict(experts={"ep": 2})),
}
ROUNDING = 1e-6  # float32 sums of 4 ranks' gradients in another order


def _errors(rank, world_size):
    out = {name: train_on_mesh(rank, world_size, model, "bucketed", steps=2, grad_error=True, **kw)[2]
           for name, (model, kw) in EXACT_CASES.items()}
    out["none, tp 2"] = train_on_mesh(rank, world_size, "transformer", "none", tp=2, steps=1, grad_error=True)[2]
    out["none, dp only"] = train_on_mesh(rank, world_size, "transformer", "none", steps=1, grad_error=True)[2]
    return out


errors = ranks_fixture(_errors, 4)


@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_an_exact_strategy_measures_zero_on_every_layout(errors, case):
    for rank in errors:
        measured = [step["grad_error"] for step in rank[case]]
        assert len(measured) == 2 and all(0 <= e < ROUNDING for e in measured), (case, measured)


def test_no_sync_measures_each_ranks_distance_from_the_average_on_a_mesh_too(errors):
    """strategy=none delivers each rank's own gradient: far from the average, on every rank alike."""
    for case in ("none, tp 2", "none, dp only"):
        values = {round(rank[case][0]["grad_error"], 9) for rank in errors}
        assert len(values) == 1 and values.pop() > 0.05, case
