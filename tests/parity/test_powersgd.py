"""PowerSGD: exact at full rank, error feedback by hand at rank 1, bytes as planned.

- With every matrix compressed (min_compression_rate 0) at a rank >= its full rank, P Q^T is the
  projection of the average onto its own column space, i.e. the average: training equals the
  single-process reference to float32 rounding (frozen, tied, Transformer; several buckets; 2 and 3
  ranks). With the default rule such matrices are not worth compressing and are sent exactly.
- At rank 1, two steps of known gradients G_k (loss = sum(W * G_k)): the delivered gradient and the
  error each rank keeps match a hand computation (normalize, project), and the second step's
  delivered gradient carries the first step's residual.
- comm_bytes per step: the whole gradient on plain steps, P's + Q's + the uncompressed tensors
  after start_iter, as facts() plans.
"""

from functools import partial

import pytest
import torch
from torch import nn

from ddp_lab.check.models import mid_mb
from ddp_lab.check.parity import assert_parity, train_distributed
from ddp_lab.check.ranks import run_ranks
from ddp_lab.strategies import PowerSGD
from ddp_lab.strategies.powersgd import Q_SEED
from tests.helpers.distributed import ranks_fixture


class CompressEverything(PowerSGD):
    min_compression_rate = 0.0


def full_rank(module):
    return CompressEverything(module, bucket_mb=mid_mb(module), rank=10**6, start_iter=0)


# SGD, not AdamW: an embedding row no token used has gradient 0 exactly in the reference and about
# 1e-9 (rounding) after P Q^T, which Adam's g / sqrt(v) would blow up into a whole step.
SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}


def _run(rank, world_size, models):
    """Every scenario of this file in one set of rank processes (starting ranks is the slow part)."""
    out = {name: train_distributed(rank, world_size, full_rank, name, batch_size=2 * world_size,
                                   optimizer_cls=torch.optim.SGD, opt_kwargs=SGD, inspect=lambda w, o: w.facts())
           for name in models}
    if world_size == 2:
        out["default_rule"] = train_distributed(
            rank, world_size, partial(PowerSGD, rank=10**6, start_iter=0), "transformer",
            optimizer_cls=torch.optim.SGD, opt_kwargs=SGD, inspect=lambda w, o: w.facts())
        out["two_steps"] = _two_steps(rank, world_size)
        out["overflow"] = _two_steps(rank, world_size, overflow_first=True)
        out["scaled"] = _scaled_steps(rank, world_size)
        out["accumulated"] = train_distributed(rank, world_size, full_rank, "tied", grad_accum_steps=2,
                                               optimizer_cls=torch.optim.SGD, opt_kwargs=SGD)
        out["plain_then_compressed"] = _plain_then_compressed(rank, world_size)
    return out


two = ranks_fixture(_run, 2, ("frozen", "tied", "transformer"))


def test_full_rank_reproduces_the_exact_average(two):
    for name in ("frozen", "tied", "transformer"):
        facts = two[0][name][2]
        assert facts["powersgd"]["matrices_compressed"] > 0 and facts["buckets"]["count"] > 1
        assert_parity([r[name][:2] for r in two])


def test_full_rank_at_an_odd_world_size():
    results = run_ranks(_run, 3, ("tied",))
    assert_parity([r["tied"][:2] for r in results])


def test_matrices_not_worth_compressing_are_sent_exactly(two):
    assert two[0]["default_rule"][2]["powersgd"]["matrices_compressed"] == 0
    assert_parity([r["default_rule"][:2] for r in two])


class Weighted(nn.Module):
    """loss = sum(W * G): the gradient of W is G, whatever W is."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(5, 3))
        self.bias = nn.Parameter(torch.zeros(3))  # 1-D: sent exactly

    def forward(self, g, h):
        return (self.weight * g).sum() + (self.bias * h).sum()


def grads(step: int, rank: int):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 3, generator=generator, dtype=torch.float64), torch.randn(3, generator=generator,
                                                                                   dtype=torch.float64)


def _two_steps(rank, world_size, overflow_first=False):
    wrapper = PowerSGD(Weighted(), rank=1, start_iter=0)
    out = []
    for step in range(2):
        g, h = grads(step, rank)
        if overflow_first and step == 0 and rank == 0:
            g[1, 2] = float("inf")
        wrapper.module.weight.grad = wrapper.module.bias.grad = None
        wrapper(g.float(), h.float()).backward()
        wrapper.finish_gradient_synchronization()
        comm = wrapper.comm.pop()
        out.append({"weight": wrapper.module.weight.grad.clone(), "bias": wrapper.module.bias.grad.clone(),
                    "error": wrapper._errors[0].view(5, 3).clone(), "comm": comm})
    return out, wrapper.facts()


SCALES = (2.0**10, 2.0**12, 2.0**13, 2.0**12)  # fp16's loss scale per step: grows, then backs off
OVERFLOW_AT = 2  # rank 0's gradient holds an inf at this step: the scaler skips it


def _scaled_steps(rank, world_size):
    """Four steps of known gradients carrying a changing loss scale, the third overflowing on rank 0."""
    wrapper = PowerSGD(Weighted(), rank=1, start_iter=0)
    out = []
    for step, scale in enumerate(SCALES):
        g, h = grads(step, rank)
        if step == OVERFLOW_AT and rank == 0:
            g[1, 2] = float("inf")
        wrapper.module.weight.grad = wrapper.module.bias.grad = None
        wrapper.grad_scale = scale  # as the train step sets it
        (wrapper(g.float(), h.float()) * scale).backward()
        wrapper.finish_gradient_synchronization()
        comm = wrapper.comm.pop()
        out.append({"weight": wrapper.module.weight.grad.clone(), "error": wrapper._errors[0].view(5, 3).clone(),
                    "q": wrapper._q[0].clone(), "comm": comm})
    return out


def _by_hand(world_size, steps=(0, 1)):
    """Rank-1 PowerSGD in float64 with explicit normalizations, from the initial Q and zero error on the
    gradients of `steps`: per step, the delivered matrix and every rank's error."""
    q = torch.randn(3, generator=torch.Generator().manual_seed(Q_SEED), dtype=torch.float32).double()
    errors = [torch.zeros(5, 3, dtype=torch.float64) for _ in range(world_size)]
    out = []
    for step in steps:
        m = [grads(step, k)[0] + errors[k] for k in range(world_size)]  # error feedback
        q = q / q.norm()
        p = sum(mk @ q for mk in m)
        p = p / p.norm()
        q = sum(mk.t() @ p for mk in m) / world_size
        delivered = torch.outer(p, q)
        errors = [mk - delivered for mk in m]
        out.append({"weight": delivered, "errors": errors,
                    "bias": sum(grads(step, k)[1] for k in range(world_size)) / world_size})
    return out


def test_error_feedback_carries_the_residual_by_hand(two):
    world_size = 2
    expected = _by_hand(world_size)
    for rank, (steps, _) in enumerate(r["two_steps"] for r in two):
        for step, (got, want) in enumerate(zip(steps, expected)):
            torch.testing.assert_close(got["weight"].double(), want["weight"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got["bias"].double(), want["bias"], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(got["error"].double(), want["errors"][rank], atol=1e-5, rtol=1e-5,
                                       msg=lambda m, s=step, r=rank: f"step {s}, rank {r}: {m}")
    for step in range(2):  # every rank receives the same gradient, bit for bit
        assert torch.equal(two[0]["two_steps"][0][step]["weight"], two[1]["two_steps"][0][step]["weight"])
    # rank 1 drops most of the matrix: the residual is large, and it changes what the next step delivers
    first_error = expected[0]["errors"][0]
    assert first_error.norm() > 0.3 * grads(0, 0)[0].norm()
    without_feedback = _by_hand_without_error(world_size)
    assert not torch.allclose(without_feedback, expected[1]["weight"], atol=1e-3)


def _by_hand_without_error(world_size):
    """Step 2's delivered matrix had the residual been dropped (same warm-started Q)."""
    step0 = _by_hand(world_size)[0]
    q = step0["weight"][0] / step0["weight"][0].norm()  # step 1's Q: the delivered matrix's row direction
    m = [grads(1, k)[0] for k in range(world_size)]
    p = sum(mk @ q for mk in m)
    p = p / p.norm()
    return torch.outer(p, sum(mk.t() @ p for mk in m) / world_size)


def test_comm_bytes_are_what_is_sent(two):
    steps, facts = two[0]["two_steps"]
    plan = facts["powersgd"]
    # one bucket: [bias (3) + P (5)] and Q (3) in float32, against 15 + 3 numbers uncompressed
    assert plan["bytes_compressed_step"] == (3 + 5 + 3) * 4 and plan["bytes_plain_step"] == 18 * 4
    assert plan["compression_ratio"] == pytest.approx(18 / 11)
    for step in steps:
        assert step["comm"]["comm_bytes"] == (3 + 5 + 3) * 4
        assert step["comm"]["collectives"] == 2


def _plain_then_compressed(rank, world_size):
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64))
    wrapper = PowerSGD(model, bucket_mb=0.004, rank=2, start_iter=2)  # several buckets
    bytes_per_step = []
    for step in range(4):
        tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(10 * step + rank))
        wrapper(tokens).sum().backward()
        wrapper.finish_gradient_synchronization()
        bytes_per_step.append(wrapper.comm.pop()["comm_bytes"])
        model.zero_grad()
    return bytes_per_step, wrapper.facts()


def test_plain_all_reduce_until_start_iter_then_the_planned_bytes(two):
    bytes_per_step, facts = two[0]["plain_then_compressed"]
    plan = facts["powersgd"]
    assert facts["buckets"]["count"] > 1
    # embedding 64x32 and linear 64x32 at rank 2: (64 + 32) * 2 each, the bias 64 exactly
    assert plan["bytes_compressed_step"] == (2 * 96 * 2 + 64) * 4
    assert plan["bytes_plain_step"] == (2 * 64 * 32 + 64) * 4
    assert bytes_per_step == [plan["bytes_plain_step"]] * 2 + [plan["bytes_compressed_step"]] * 2


def test_an_overflowing_step_does_not_poison_the_next(two):
    fresh = _by_hand(2, steps=(1,))[0]  # step 1's gradients from the initial Q and zero error
    for rank in range(2):
        overflowed, after = two[rank]["overflow"][0]
        assert not torch.isfinite(overflowed["weight"]).all()
        torch.testing.assert_close(after["weight"].double(), fresh["weight"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(after["error"].double(), fresh["errors"][rank], atol=1e-5, rtol=1e-5)


def test_full_rank_with_gradient_accumulation(two):
    assert_parity([r["accumulated"] for r in two])


def test_error_feedback_is_unscaled_and_a_skipped_step_leaves_it(two):
    """Under a loss scale that grows and backs off, the delivered gradient is the scale times the hand
    computation's, the kept error is the unscaled hand error whatever the scale, and the overflowing
    step (skipped by the scaler) leaves every error and Q as they were: the hand computation simply
    leaves that step out."""
    expected = _by_hand(2, steps=[s for s in range(len(SCALES)) if s != OVERFLOW_AT])
    for rank in range(2):
        steps = two[rank]["scaled"]
        assert not torch.isfinite(steps[OVERFLOW_AT]["weight"]).all()
        assert torch.equal(steps[OVERFLOW_AT]["error"], steps[OVERFLOW_AT - 1]["error"])
        assert torch.equal(steps[OVERFLOW_AT]["q"], steps[OVERFLOW_AT - 1]["q"])
        kept = [s for i, s in enumerate(steps) if i != OVERFLOW_AT]
        scales = [s for i, s in enumerate(SCALES) if i != OVERFLOW_AT]
        for step, (got, want, scale) in enumerate(zip(kept, expected, scales)):
            torch.testing.assert_close(got["weight"].double() / scale, want["weight"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got["error"].double(), want["errors"][rank], atol=1e-5, rtol=1e-5,
                                       msg=lambda m, s=step, r=rank: f"step {s}, rank {r}: {m}")
        assert steps[-1]["comm"]["compress_ms"] > 0
