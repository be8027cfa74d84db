"""Every data-parallel strategy on every axis docs/compose.md has a column for (its strategy rows): the strategy on
the data-parallel axis of a 4-rank mesh (tests/helpers/mesh_axes.py), trained 2 steps from a different init on every
rank, ends where one process trained on the full batch ends, to float32 rounding (the mesh sums in another order).

The cells are spec/compose.py's `strategy_cases()`: each strategy on each axis its spec does not refuse, as
launch.py asks it. The exact strategies train with AdamW; powersgd uncompressed (rank 64 from the first step) and
local_sgd averaging every step, with momentum SGD, where they are exact; demo changes the average on purpose, so its
replicas are held equal to each other instead. `none` synchronizes nothing: its cells are proven where the mesh leaves
one replica (compose.py's floor proofs).

Two sets of ranks, each building each of its layouts' groups once (parallel/mesh.py): a gloo group keeps its threads
until it is destroyed, and 150 meshes built afresh in one set of ranks left 2,000 threads a rank and made its last
meshes a hundred times slower than its first."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from ddp_lab.check.parity import assert_parity, train_on_mesh
from ddp_lab.spec.compose import strategy_cases
from tests.helpers.distributed import ranks_fixture
from tests.helpers.mesh_axes import AXIS_JOBS

MOMENTUM = {"optimizer_cls": partial(torch.optim.SGD, momentum=0.9), "opt_kwargs": {"lr": 0.05, "weight_decay": 0.0}}
EXACTLY = {"powersgd": {"knobs": {"rank": 64, "start_iter": 0}}, "local_sgd": {"knobs": {"sync_every": 1}, **MOMENTUM}}
"""The knobs that make a strategy exact, where its defaults are not."""
FAMILIES = {"tp and pp": ("tp", "tp torch", "sp", "gpipe", "1f1b", "interleaved", "zero bubble"),
            "cp and ep": ("ring", "zigzag", "ulysses", "hybrid", "cp torch", "ep")}
CASES = {f"{strategy}-{axis.name}": (strategy, axis.name) for strategy, axis in strategy_cases()}
assert {axis for _, axis in CASES.values()} <= {a for family in FAMILIES.values() for a in family}


def _family(rank, world_size, family):
    out = {}
    for key, (strategy, axis) in CASES.items():
        if axis in FAMILIES[family]:
            model, kw = AXIS_JOBS[axis]
            out[key] = train_on_mesh(rank, world_size, model, strategy, steps=2, **kw, **EXACTLY.get(strategy, {}))
    return out


families = {family: ranks_fixture(_family, 4, family) for family in FAMILIES}
tp_and_pp, cp_and_ep = families.values()


@pytest.fixture
def ranks(request):
    """The results of the family of axes the case's column belongs to."""
    axis = CASES[request.node.callspec.params["case"]][1]
    return request.getfixturevalue(next(f.replace(" ", "_") for f, axes in FAMILIES.items() if axis in axes))


@pytest.mark.parametrize("case", [k for k, (strategy, _) in CASES.items() if strategy != "demo"])
def test_every_strategy_trains_like_one_process_on_every_axis(ranks, case):
    assert_parity([r[case] for r in ranks])


@pytest.mark.parametrize("case", [k for k, (strategy, _) in CASES.items() if strategy == "demo"])
def test_demo_keeps_its_replicas_equal_on_every_axis(ranks, case):
    """DeMo's top-k changes the average on purpose: every rank's weights, put back together over its mesh, are the
    same bit for bit (every replica applied the same update), and not one process's."""
    first, reference = ranks[0][case]
    for rank in ranks[1:]:
        for name, tensor in first.items():
            assert torch.equal(tensor, rank[case][0][name]), name
    assert any(not torch.equal(first[n], reference[n]) for n in reference)
