"""`train.precision` and `measure.grad_error` inside ranks (one process start per world size).

- bf16 and fp16 at 2 ranks train to the weights of a single process that autocasts (and scales)
  the same way, bit for bit: the reference accumulates the two ranks' slices as two micro-batches,
  each loss halved (ddp_lab/check/parity.py's `exact_reference`). Each slice's forward and backward
  run the same bf16 kernels on the same inputs in both; halving commutes with bf16/fp16 rounding, and
  the fp32 gradients are then averaged exactly as the reference accumulates them.
- The hand-written loss scaler follows torch.amp.GradScaler step for step (scale, skipped steps,
  weights), and with a sharded optimizer an inf on one rank skips the step on every rank.
- grad_error is 0 for exact fp32 averaging, and for bf16 on the wire the same value whichever way
  the gradient is cut (per tensor, buckets, zero2's slices of buckets, zero1's owners).
"""

from __future__ import annotations

import copy
import functools
from functools import partial

import pytest
import torch

from ddp_lab.check.models import MODELS, mid_mb
from ddp_lab.check.parity import assert_parity, data_cfg, train_distributed
from ddp_lab.check.ranks import run_ranks
from ddp_lab.rank.grad_error import GradErrorProbe
from ddp_lab.rank.precision import LossScaler, Precision
from ddp_lab.rank.step import loss_fn, train_step
from ddp_lab.strategies import BucketedDDP, FlatDDP, NaiveDDP, Zero1, Zero2

PARITY = {
    "flat": FlatDDP,
    "bucketed": lambda m: BucketedDDP(m, bucket_mb=mid_mb(m)),
    "zero2": lambda m: Zero2(m, bucket_mb=mid_mb(m)),
}
ERRORS = {
    "naive": NaiveDDP,
    "bucketed": lambda m, **k: BucketedDDP(m, bucket_mb=mid_mb(m), **k),
    "zero1_reduce_scatter": partial(Zero1, comm="reduce_scatter"),
    "zero2": lambda m, **k: Zero2(m, bucket_mb=mid_mb(m), **k),
}


def _measure(into: dict, probe: GradErrorProbe, optimizer) -> None:
    into.update(probe.measure(optimizer))


def _grad_errors(rank, world_size):
    """grad_error of one step of each strategy and comm dtype on the tiny Transformer."""
    from ddp_lab.rank.data import BatchSource
    out = {}
    for name, make in ERRORS.items():
        for dtype in ("fp32", "bf16"):
            torch.manual_seed(rank)
            module = MODELS["transformer"]()
            probe = GradErrorProbe(module)
            wrapper = make(module, comm_dtype=dtype)
            optimizer = wrapper.make_optimizer(torch.optim.AdamW, lr=1e-3)
            measured = {}
            for step in range(2):
                cfg = data_cfg(batch_size=4 * world_size)
                batches = list(BatchSource(cfg, rank, world_size, torch.device("cpu")).micro_batches(step))
                train_step(wrapper, optimizer, batches, before_step=partial(_measure, measured, probe, optimizer))
            out[name, dtype] = measured.get("grad_error")
    return out


def _scaler_skips_everywhere(rank, world_size):
    """zero2 + fp16: an inf in rank 1's gradient shard only; every rank must skip the step."""
    torch.manual_seed(rank)
    wrapper = Zero2(MODELS["norms"](), bucket_mb=1.0)
    optimizer = wrapper.make_optimizer(torch.optim.AdamW, lr=1e-2)
    mixed = Precision("fp16", agree_over_ranks=True)
    from ddp_lab.check.parity import global_batch
    tokens = global_batch(0)[rank::world_size]
    with mixed.autocast():
        logits = wrapper(tokens[:, :-1])
    mixed.backward(loss_fn(logits.float(), tokens[:, 1:]))
    wrapper.finish_gradient_synchronization()
    if rank == 1:
        wrapper.local_shards()[0].grad[0] = float("inf")
    before = [p.detach().clone() for p in wrapper.module.parameters()]
    mixed.step(optimizer)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, wrapper.module.parameters()))
    return unchanged, mixed.scaler.scale, mixed.scaler.skipped_steps


def _everything(rank, world_size):
    out = {"errors": _grad_errors(rank, world_size)}
    if world_size == 2:
        for precision in ("bf16", "fp16"):
            for name, make in PARITY.items():
                out[precision, name] = train_distributed(rank, world_size, make, "transformer", exact_reference=True,
                                                         precision=precision)
        out["fp32", "flat"] = train_distributed(rank, world_size, FlatDDP, "transformer", exact_reference=True)
        out["skips"] = _scaler_skips_everywhere(rank, world_size)
    return out


@functools.lru_cache(maxsize=None)
def ranks(world_size):
    return run_ranks(_everything, world_size)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", list(PARITY))
def test_mixed_precision_matches_a_single_process_autocast_the_same_way(name, precision):
    results = [r[precision, name] for r in ranks(2)]
    assert_parity(results, exact=True)


def test_mixed_precision_is_not_fp32():
    """Guards the guard: the bf16 weights differ from the fp32 ones the same run would reach."""
    fp32 = ranks(2)[0]["fp32", "flat"][0]
    bf16 = ranks(2)[0]["bf16", "flat"][0]
    assert any(not torch.equal(fp32[k], bf16[k]) for k in fp32)


def test_sharded_optimizer_skips_the_step_on_every_rank():
    for unchanged, scale, skipped in (r["skips"] for r in ranks(2)):
        assert unchanged and scale == 2.0**15 and skipped == 1


def test_loss_scaler_follows_torch_grad_scaler():
    """Same model, same fp16 autocast, a scale big enough to overflow at first: the same skipped
    steps, scales and weights as torch.amp.GradScaler (growth every 2 clean steps to see growth too)."""
    torch.manual_seed(0)
    ours_model = MODELS["norms"]()
    theirs_model = copy.deepcopy(ours_model)
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=1e-2)
    theirs_opt = torch.optim.AdamW(theirs_model.parameters(), lr=1e-2)
    ours = LossScaler(init_scale=2.0**24, growth_interval=2)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=2)
    from ddp_lab.check.parity import global_batch
    scales = []
    for step in range(16):
        tokens = global_batch(step)
        for model, opt, scaler in ((ours_model, ours_opt, ours), (theirs_model, theirs_opt, theirs)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(tokens[:, :-1])
            loss = loss_fn(logits.float(), tokens[:, 1:])
            if scaler is ours:
                ours.scaled(loss).backward()
                ours.step(opt)
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        scales.append((ours.scale, theirs.get_scale()))
    assert all(a == b for a, b in scales), scales
    assert ours.skipped_steps >= 1 and scales[-1][0] > min(s for s, _ in scales)  # it backed off and grew
    for a, b in zip(ours_model.parameters(), theirs_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("world_size", [2, 3])
def test_grad_error_is_zero_when_exact_and_the_same_for_every_cut_in_bf16(world_size):
    errors = ranks(world_size)[0]["errors"]
    assert all(r["errors"] == errors for r in ranks(world_size))  # every rank records the same value
    for name in ERRORS:
        assert errors[name, "fp32"] is not None and errors[name, "fp32"] < 1e-6, (name, errors)
        assert 1e-4 < errors[name, "bf16"] < 1e-2, (name, errors)  # bf16 keeps 8 bits: ~2^-9 relative
    if world_size == 2:  # one rounding per rank's half and one per sum of two, element by element
        values = [errors[name, "bf16"] for name in ERRORS]  # summed in float64 in different orders
        assert max(values) - min(values) <= 1e-9 * max(values), errors
