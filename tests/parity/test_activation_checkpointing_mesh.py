"""`train.activation_checkpointing` on every axis: under tensor parallelism (the lab's and DTensor's, with sequence
parallelism), every pipeline schedule (the lab's and torch's), every context-parallel implementation, and a mixture
of experts alone and under expert parallelism (both impls, either balance), full and selective checkpointing train to
the same weights as the same mesh without it, bit for bit (the same operations replayed on the same inputs); the
mesh without it is proven against one process elsewhere (test_tensor_parallel.py, test_pipeline.py,
test_context_parallel.py, test_experts.py). Checkpointing is applied to each rank's blocks after the mesh has cut
them, as the trainer applies it.

What a recompute sends again is counted where it is sent: the forward's collectives inside a block run again in its
backward. Context parallelism's exchange and expert parallelism's two all-to-alls are recomputed, not saved (the
selective policy keeps matmuls' outputs only), so a step's forward bytes count twice; tensor parallelism's
all-reduce at the end of a block is not (torch's non-reentrant checkpoint stops recomputing once the tensors
backward needs are back)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from ddp_lab.check.parity import train_on_mesh
from ddp_lab.rank.recompute import _checkpointed
from ddp_lab.spec.figures import CP_BYTES_BACKWARD, CP_BYTES_FORWARD, TP_COLLECTIVES
from ddp_lab.spec.parallel import checkpointing_problem
from tests.helpers.distributed import ranks_fixture
from tests.helpers.moe import tiny_moe

MODES = ("full", "selective")
STEPS = 2  # the figures are summed over them


def _pp(schedule, impl, v=1) -> dict:
    return {"pipeline": {"pp": 2, "pp_schedule": schedule, "pp_impl": impl, "microbatches": 4,
                         "stages_per_rank": v}}


def _cases() -> dict:
    cases = {f"tp {impl}{' sp' if sp else ''}": ("transformer", dict(tp=2, impl=impl, sequence_parallel=sp))
             for impl in ("lab", "torch") for sp in (False, True)}
    for impl in ("lab", "torch"):
        for schedule in ("gpipe", "1f1b", "zero_bubble"):
            cases[f"pp {schedule} {impl}"] = ("transformer", _pp(schedule, impl))
        cases[f"pp interleaved {impl}"] = ("deep_transformer", _pp("interleaved_1f1b", impl, v=2))
    for impl in ("ring", "zigzag", "ulysses", "torch"):
        cases[f"cp {impl}"] = ("transformer", dict(context={"cp": 2, "cp_impl": impl}))
    cases["mixture"] = (tiny_moe(), {})  # the balancing loss's counts all-reduced in the recompute too
    for impl in ("lab", "torch"):
        cases[f"ep {impl}"] = (tiny_moe(), dict(experts={"ep": 2, "ep_impl": impl}))
    cases["ep bias"] = (tiny_moe(balance="bias"), dict(experts={"ep": 2}))
    return cases


def _refused(case: str, mode: str) -> bool:
    """The zero-bubble schedule under `selective`: torch refuses a second backward through a selective region, and
    the schedule's backward runs in two (the launcher refuses it: spec/parallel.py's `checkpointing_problem`)."""
    return "zero_bubble" in case and mode == "selective"


def _wrapped(module) -> int:
    """How many of the rank's modules run checkpointed."""
    return sum(isinstance(m.__dict__.get("forward"), partial) and m.forward.func is _checkpointed
               for m in module.modules())


def _inspect(parallel, ddp, optimizer):
    return {"checkpointed": _wrapped(ddp.module), **parallel.pop()}


def _run(rank, world_size):
    cases = _cases()  # built in the rank: a mixture's factory does not pickle
    return {(name, mode): train_on_mesh(rank, world_size, model, "flat", steps=STEPS, checkpointing=mode,
                                        inspect=_inspect, **kw)
            for name, (model, kw) in cases.items() for mode in ("none", *MODES) if not _refused(name, mode)}


results = ranks_fixture(_run, 2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(_cases()))
def test_checkpointing_on_a_mesh_trains_the_same_weights_bit_for_bit(results, case, mode):
    if _refused(case, mode):  # the launcher says so before any rank starts
        assert "one backward per region" in checkpointing_problem(mode, 2, "zero_bubble")
        return
    for rank in results:
        (plain, _, _), (recomputed, _, seen) = rank[(case, "none")], rank[(case, mode)]
        assert seen["checkpointed"] > 0, "no block of this rank was checkpointed"
        assert plain.keys() == recomputed.keys()
        for key in plain:
            assert torch.equal(plain[key], recomputed[key]), (case, mode, key)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", ["ring", "zigzag", "ulysses", "torch"])
def test_the_context_exchange_is_recomputed_and_its_bytes_counted_twice(results, impl, mode):
    for rank in results:
        plain, recomputed = rank[(f"cp {impl}", "none")][2], rank[(f"cp {impl}", mode)][2]
        assert recomputed[CP_BYTES_FORWARD.key] == 2 * plain[CP_BYTES_FORWARD.key] > 0
        assert recomputed[CP_BYTES_BACKWARD.key] == plain[CP_BYTES_BACKWARD.key]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["tp lab", "tp lab sp"])
def test_recomputation_runs_each_blocks_tp_collectives_but_its_last_again(results, case, mode):
    """What the planner prices (analysis/plan/price.py's tp term): under full checkpointing, each block's all-reduce
    after attention (or sequence parallelism's all-gather and reduce-scatter around it, and the MLP's all-gather) is
    run again in its backward, the one after its MLP is not, as torch's checkpoint stops once backward's tensors are
    back: 1 more all-reduce per block of the tiny Transformer (2 regions). Selective too: its policy keeps the
    matmuls' outputs, not the all-reduce's (the lab's record counted 5 a block at context 160 to 384,
    docs/measured/plan_tp_wait.md)."""
    extra = 3 if case.endswith("sp") else 1  # sp: ag + rs around attention, ag before the MLP
    for rank in results:
        plain, recomputed = rank[(case, "none")][2], rank[(case, mode)][2]
        assert recomputed[TP_COLLECTIVES.key] - plain[TP_COLLECTIVES.key] == STEPS * 2 * extra, (plain, recomputed)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", ["lab", "torch"])
def test_the_expert_exchange_is_recomputed_and_its_forward_bytes_counted_twice(results, impl, mode):
    for rank in results:
        plain, recomputed = rank[(f"ep {impl}", "none")][2], rank[(f"ep {impl}", mode)][2]
        for way in ("dispatch", "combine"):
            assert recomputed[f"ep_bytes_{way}_forward"] == 2 * plain[f"ep_bytes_{way}_forward"] > 0
            assert recomputed[f"ep_bytes_{way}_backward"] == plain[f"ep_bytes_{way}_backward"]
