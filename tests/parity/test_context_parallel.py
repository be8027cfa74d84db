"""Context parallelism: the attention alone in float64, and training on every layout, against one process.

The attention alone: one causal attention over a whole sequence on one process (the model's SDPA), and the same
on cp ranks each holding its tokens (spec/context.py's layout), forward and every input's gradient, float64, to
1e-12 for every implementation at cp 2 and 4. Training: `train_on_mesh` with the mesh's `cp` axis (each rank
reading its tokens of every sequence, its rotary embedding at their global positions, the strategy averaging over
dp x cp) against single-process training on the full sequences, fp32 to rounding (check/parity.py's ATOL 1e-5,
RTOL 1e-4): every implementation at cp 2 and 4 (dp x cp under every strategy: test_strategy_mesh.py), cp x tp, pp x
cp, the hybrid, a frozen and a tied parameter. The bytes each rank sends and the query-key pairs it scores are
counted by the runtime and held to spec/context.py's formulas. And the traps seen while building it, each as a test
that fails on the trapped version.
"""

from __future__ import annotations

import pytest
import torch

from ddp_lab.check.models import CONTEXT, VOCAB
from ddp_lab.check.parity import assert_parity, train_on_mesh
from ddp_lab.models.transformer import Transformer
from ddp_lab.spec.context import context_problem, exchange_bytes, imbalance, work_pairs
from ddp_lab.spec.figures import CP_BYTES_BACKWARD, CP_BYTES_FORWARD, CP_PAIRS
from tests.helpers.distributed import ranks_fixture

IMPLS = ["ring", "zigzag", "ulysses", "torch"]
B, H, S, D = 2, 4, 16, 8  # the attention alone: batch, heads, tokens, head_dim


SGD = {"optimizer_cls": torch.optim.SGD, "opt_kwargs": {"lr": 0.1, "weight_decay": 0.0}}
"""For the tied model: one element of its blocks.1 q projection has a gradient of 3.7e-8 (the largest 0.036), which
AdamW's first step turns into 0.79 lr, and the rounding of that gradient, which differs with any other order of
summation, into 2.4e-4 of weight (measured; the same run under SGD is within 1.2e-7)."""


def tied_frozen_transformer():
    """The tiny Transformer with its output tied to its embedding and one frozen weight."""
    model = Transformer(vocab_size=VOCAB, context_length=CONTEXT, d_model=32, d_ff=64, num_layers=2, num_heads=4)
    model.lm_head.weight = model.embed.weight
    model.blocks[0].ffn.w3.weight.requires_grad_(False)
    return model


def _attention_alone(rank, world_size, impl, ulysses=2, exchange=None):
    """(max error of the output and of dq, dk, dv against one process, this rank's tally) for `impl`."""
    from ddp_lab.context_parallel import ContextParallel
    from ddp_lab.parallel.mesh import Mesh
    from ddp_lab.spec.parallel import MeshLayout

    if exchange is not None:
        import ddp_lab.context_parallel.ulysses as ulysses_module

        ulysses_module._exchange = exchange
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, S, D, dtype=torch.float64) for _ in range(4))
    layout = MeshLayout(world_size, cp=world_size)
    mesh = Mesh(layout)
    context = ContextParallel(layout, mesh.cp_rank, mesh.cp_group, impl, ulysses)
    at = context.positions(S, "cpu")
    mine = [t[:, :, at].clone().requires_grad_() for t in (q, k, v)]
    out = context.attend(*mine)
    out.backward(dout[:, :, at])
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=True)
    reference.backward(dout)
    errors = [(out - reference[:, :, at]).abs().max().item()]
    errors += [(a.grad - b.grad[:, :, at]).abs().max().item() for a, b in zip(mine, whole)]
    return errors, context.pop()


def _scrambling_exchange(x, group, tally):
    """The trap: the all-to-all's output made with empty_like of a permuted (non-contiguous) tensor."""
    import torch.distributed as dist

    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def _attention_cases(rank, world_size):
    out = {impl: _attention_alone(rank, world_size, impl) for impl in IMPLS}
    if world_size == 4:
        out["hybrid"] = _attention_alone(rank, world_size, "hybrid", ulysses=2)
    return out


def _trap(rank, world_size):
    return _attention_alone(rank, world_size, "ulysses", exchange=_scrambling_exchange)[0]


def _cp_cases(cp: int) -> dict:
    cases = {impl: ("transformer", "flat", dict(context={"cp": cp, "cp_impl": impl})) for impl in IMPLS}
    cases["ring tied frozen"] = (tied_frozen_transformer, "flat", dict(context={"cp": cp}, **SGD))
    cases["zigzag accumulation"] = ("transformer", "flat", dict(context={"cp": cp, "cp_impl": "zigzag"},
                                                                grad_accum_steps=2))
    return cases


def _mesh_cases() -> dict:
    cases = {"hybrid 2x2": ("transformer", "flat", dict(context={"cp": 4, "cp_impl": "hybrid", "cp_ulysses": 2}))}
    cases["dp x cp bucketed tied frozen"] = (tied_frozen_transformer, "bucketed", dict(context={"cp": 2}, **SGD))
    for impl in ("ring", "ulysses"):
        for tp_impl in ("lab", "torch"):
            cases[f"cp x tp {impl} {tp_impl}"] = ("transformer", "flat", dict(tp=2, impl=tp_impl,
                                                                              context={"cp": 2, "cp_impl": impl}))
    cases["cp x tp sequence parallel"] = ("transformer", "flat", dict(tp=2, sequence_parallel=True,
                                                                      context={"cp": 2, "cp_impl": "zigzag"}))
    for pp_impl in ("lab", "torch"):
        cases[f"pp x cp {pp_impl}"] = ("transformer", "flat", dict(
            pipeline={"pp": 2, "microbatches": 2, "pp_impl": pp_impl}, context={"cp": 2, "cp_impl": "zigzag"}))
    # the embedding on the first stage, its tied head on the last: the copies' groups span every cp rank's pair of
    # stages (they were built at cp index 0 only, leaving half the ranks summing over the world: a hang)
    # activation checkpointing and compile across the axes, against one process (each axis alone: against the mesh
    # without them, test_activation_checkpointing_mesh.py and test_compile_mesh.py)
    cases["hybrid 2x2 selective checkpointing"] = ("transformer", "flat", dict(
        context={"cp": 4, "cp_impl": "hybrid", "cp_ulysses": 2}, checkpointing="selective"))
    cases["hybrid 2x2 compiled"] = ("transformer", "flat", dict(
        context={"cp": 4, "cp_impl": "hybrid", "cp_ulysses": 2}, compile_backend="aot_eager"))
    cases["hybrid 2x2 full checkpointing"] = ("transformer", "flat", dict(
        context={"cp": 4, "cp_impl": "hybrid", "cp_ulysses": 2}, checkpointing="full"))
    cases["pp x cp x dp full checkpointing"] = ("transformer", "bucketed", dict(
        pipeline={"pp": 2, "microbatches": 2}, context={"cp": 2, "cp_impl": "zigzag"}, checkpointing="full"))
    cases["cp x tp sequence parallel selective checkpointing"] = ("transformer", "flat", dict(
        tp=2, sequence_parallel=True, context={"cp": 2, "cp_impl": "ring"}, checkpointing="selective"))
    cases["pp x cp tied across stages"] = (tied_frozen_transformer, "flat", dict(
        pipeline={"pp": 2, "microbatches": 2}, context={"cp": 2, "cp_impl": "zigzag"}, **SGD))
    return cases


def _run(rank, world_size, cases):
    return {key: train_on_mesh(rank, world_size, model, strategy, **kw) for key, (model, strategy, kw) in cases.items()}


attention2 = ranks_fixture(_attention_cases, 2)
attention4 = ranks_fixture(_attention_cases, 4)
cp2 = ranks_fixture(_run, 2, _cp_cases(2))
cp4 = ranks_fixture(_run, 4, {**_cp_cases(4), **_mesh_cases()})


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_alone_matches_one_process_at_cp2(attention2, impl):
    for errors, _ in (r[impl] for r in attention2):
        assert max(errors) < 1e-12, errors


@pytest.mark.parametrize("impl", IMPLS + ["hybrid"])
def test_attention_alone_matches_one_process_at_cp4(attention4, impl):
    for errors, _ in (r[impl] for r in attention4):
        assert max(errors) < 1e-12, errors


@pytest.mark.parametrize("fixture,cp", [("attention2", 2), ("attention4", 4)])
def test_bytes_sent_are_the_formula(request, fixture, cp):
    """What each rank sent forward and backward, counted as it sent it (torch's by its source's formula), is
    spec/context.py's: the ring's does not shrink with cp, Ulysses' does."""
    results = request.getfixturevalue(fixture)
    tokens = B * S // cp
    for impl in IMPLS + (["hybrid"] if cp == 4 else []):
        want = exchange_bytes(impl, cp, 2, tokens, H * D, H * D, 8)
        for rank in results:
            tally = rank[impl][1]
            counted = (tally[CP_BYTES_FORWARD.key], tally[CP_BYTES_BACKWARD.key])
            assert counted == (want["forward"], want["backward"]), impl


@pytest.mark.parametrize("fixture,cp", [("attention2", 2), ("attention4", 4)])
def test_attention_work_is_the_formula(request, fixture, cp):
    """The query-key pairs each rank scored (times heads), counted block by block, are spec/context.py's: a
    contiguous ring's last rank does the most, zigzag and Ulysses the same on every rank."""
    results = request.getfixturevalue(fixture)
    for impl in ("ring", "zigzag", "ulysses") + (("hybrid",) if cp == 4 else ()):
        counted = [rank[impl][1][CP_PAIRS.key] for rank in results]
        assert counted == [work_pairs(r, cp, impl, 2, S, H) for r in range(cp)], impl
        if impl in ("zigzag", "ulysses"):
            assert len(set(counted)) == 1
    ring = [rank["ring"][1][CP_PAIRS.key] for rank in results]
    assert ring == sorted(ring) and ring[-1] > ring[0]


def test_contiguous_imbalance_approaches_two_minus_one_over_cp():
    for cp in (2, 4, 8):
        assert imbalance(cp, "ring", 2, 1 << 16) == pytest.approx(2 - 1 / cp, rel=1e-3)
        assert imbalance(cp, "zigzag", 2, 1 << 16) == 1.0
        assert imbalance(cp, "ulysses", 2, 1 << 16) == 1.0


@pytest.mark.parametrize("case", list(_cp_cases(2)))
def test_cp2_trains_like_one_process(cp2, case):
    assert_parity([r[case] for r in cp2])


@pytest.mark.parametrize("case", list(_cp_cases(4)))
def test_cp4_trains_like_one_process(cp4, case):
    assert_parity([r[case] for r in cp4])


@pytest.mark.parametrize("case", list(_mesh_cases()))
def test_cp_on_a_mesh_trains_like_one_process(cp4, case):
    assert_parity([r[case] for r in cp4])


def test_trap_an_all_to_all_into_a_permuted_output_scrambles():
    """Guards the guard: the all-to-all written into empty_like of a permuted tensor (its strides kept) gives a
    wrong attention, and the proof above says so; the lab's exchange (a fresh contiguous output) does not."""
    from ddp_lab.check.ranks import run_ranks

    assert max(max(errors) for errors in run_ranks(_trap, 2)) > 1e-3


def test_trap_a_causal_ring_whose_last_block_is_skipped_does_not_hang(attention4):
    """At cp 4 the contiguous ring's rank 0 skips every block it receives (the mask covers them whole): a backward
    differentiated through send/recv hangs there (that rank's never runs while its peers wait for it). The lab's
    ring, one autograd Function, ends: rank 0 scored only its diagonal block, and every gradient is right."""
    first = attention4[0]["ring"]
    chunk = S // 4
    assert first[1][CP_PAIRS.key] == chunk * (chunk + 1) // 2 * H
    assert max(first[0]) < 1e-12


@pytest.mark.parametrize("impl,context,problem", [
    ("zigzag", 12, "does not divide by 8"), ("torch", 12, "does not divide by 8"), ("ring", 10, "does not divide by 4"),
])
def test_trap_a_context_that_would_be_silently_unbalanced_is_refused(impl, context, problem):
    """torch turns its load balancing off silently when the sequence does not divide by 2 x cp; the lab refuses."""
    assert problem in context_problem(4, impl, 2, context, 4, 1, False)

