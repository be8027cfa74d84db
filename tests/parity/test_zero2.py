"""zero2 trains to the single-process weights, and its gradients and optimizer state really are sharded.

One `run_ranks` call per world size: at 2 ranks every scenario (and a DTensor model for the memory
accounting), at 3, 4 and 5 ranks (uneven padding) the tiny Transformer through both collective
paths. Each scenario is the parity proof of ddp_lab/check/parity.py (different init per rank,
the trainer's train_step on the trainer's data) plus what the wrapper holds at the end.

Bit for bit at 2 ranks: the reference accumulates the two ranks' slices as two micro-batches, each
loss halved. Halving is exact in binary floating point and every backward op is linear in the
upstream gradient, so each micro-batch gradient is exactly the rank's gradient halved (what zero2
divides by N before reducing), and the reduction of two values, a + b, is the autograd
accumulation's. AdamW is elementwise, so updating slices equals updating whole tensors bit for bit.
At 3 or more ranks the reduction's summation order is gloo's, not a sequential one's: float32
rounding only.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from ddp_lab.check.models import BranchyNet, mid_mb
from ddp_lab.check.parity import STEPS, assert_parity, assert_parity_each, global_batch, per_scenario, train_distributed
from ddp_lab.check.ranks import run_ranks
from ddp_lab.rank.memory import model_state_bytes
from ddp_lab.strategies import BucketedDDP, Zero2, plan_buckets

TINY_MB = 1e-6   # below every parameter: each parameter is larger than its bucket, and has one of its own


class Zero2Native(Zero2):
    """gloo's own reduce_scatter_single / all_gather_single (backend.collectives=native: nccl's calls);
    Zero2 itself runs the lab's rings, gloo's default."""

    collectives = "native"


def mid(cls, model):
    return cls(model, bucket_mb=mid_mb(model))


def inspect(ddp, optimizer) -> dict:
    """What the wrapper holds after the last step, for the assertions below."""
    trainable = [p for p in ddp.module.parameters() if p.requires_grad]
    ranges = {}
    for i, p in enumerate(trainable):
        shard = ddp.local_shard(p)
        if shard is not None:  # a view into the parameter's own storage: where it starts in the parameter
            assert shard.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
            start = shard.storage_offset() - p.storage_offset()
            ranges[i] = (start, start + shard.numel())
    return {"ranges": ranges, "numels": [p.numel() for p in trainable],
            "buckets": [sum(trainable[i].numel() for i in b) for b in plan_buckets(trainable, ddp.bucket_mb)],
            "model_bytes": sum(p.numel() * p.element_size() for p in ddp.module.parameters()),
            "shards": len(ddp.local_shards()), "comm": ddp.comm.pop(), "memory": model_state_bytes(ddp, optimizer),
            "param_grads": sum(p.grad is not None for p in ddp.module.parameters()),
            "buckets_held": sum(b is not None for b in ddp._bucket_buffers), "pooled": len(ddp._pool),
            "pooled_bytes": sum(b.numel() * b.element_size() for b in ddp._pool), "bucket_count": len(ddp._units),
            "bucket_mb": ddp.bucket_mb,
            "collectives": ddp.collectives}


# name: (wrapper, model, train_distributed's keyword arguments)
TWO = {
    "exact": (partial(Zero2, bucket_mb=0.002), "norms", {"exact_reference": True}),
    "exact_native": (partial(Zero2Native, bucket_mb=0.002), "norms", {"exact_reference": True}),
    "transformer": (partial(mid, Zero2), "transformer", {}),
    "tied": (partial(mid, Zero2), "tied", {}),
    "frozen": (partial(mid, Zero2), "frozen", {}),
    "accumulate": (partial(mid, Zero2), "transformer", {"grad_accum_steps": 2, "set_to_none": False}),
    "per_parameter": (partial(Zero2, bucket_mb=TINY_MB), "transformer", {}),
    "one_bucket": (partial(Zero2, bucket_mb=1000.0), "tied", {}),
}
EXACT = ("exact", "exact_native")
MANY = {
    "transformer": (partial(mid, Zero2), "transformer", {}),
    "transformer_native": (partial(mid, Zero2Native), "transformer", {}),
}


def _dtensor_memory(rank, world_size):
    """torch's fully_shard (DTensor parameters, gradients and state): the accounting counts local shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7, bias=False))  # 39 parameters
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    return model_state_bytes(model, optimizer)


def _unused(rank, world_size):
    """A branch one rank uses and the other not (each way), and a layer no rank uses: zero2 and
    bucketed (whose averaging of missing gradients as zeros tests/parity/test_overlap_edge_cases.py
    proves) train to the same weights, through both of zero2's collective paths, without a hang."""
    out = {}
    for name, make in (("bucketed", BucketedDDP), ("zero2", Zero2), ("zero2_native", Zero2Native)):
        torch.manual_seed(rank)
        ddp = make(BranchyNet(), bucket_mb=2.0**-9)  # 2 KiB: several buckets
        optimizer = ddp.make_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        for step, use_branch in enumerate([rank == 0, rank == 1, False]):
            optimizer.zero_grad()
            tokens = global_batch(step)[rank::world_size]
            logits = ddp(tokens[:, :-1], use_branch)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
            ddp.finish_gradient_synchronization()
            optimizer.step()
        out[name] = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    return out


def _run(rank, world_size, scenarios):
    batch = 2 * world_size  # any world size divides it
    out = {name: train_distributed(rank, world_size, make, model, batch_size=batch, inspect=inspect, **kwargs)
           for name, (make, model, kwargs) in scenarios.items()}
    if world_size == 2:
        out["dtensor"] = _dtensor_memory(rank, world_size)
        out["unused"] = _unused(rank, world_size)
    return out


@pytest.fixture(scope="module")
def two():
    return run_ranks(_run, 2, TWO)


@pytest.fixture(scope="module", params=[3, 4, 5], ids=["3ranks", "4ranks", "5ranks"])
def many(request):
    return run_ranks(_run, request.param, MANY)


@pytest.mark.parametrize("name", list(TWO))
def test_same_weights_as_single_process_at_2_ranks(two, name):
    assert_parity([r[name] for r in two], exact=name in EXACT)


def test_transformer_at_3_4_5_ranks(many):
    assert_parity_each(many, MANY)


def _assert_sharded(name, per_rank):
    """Summed over ranks the shards cover every element of every trainable parameter exactly once;
    no rank holds more than its padded 1/N of each bucket; what the memory accounting counts is
    exactly the shards (gradients) and their AdamW state; no full gradient is left after the step
    (the pool: at most 2 x bucket_mb in bytes, fewer buffers than buckets)."""
    n = len(per_rank)
    extras = [r[2] for r in per_rank]
    for i, numel in enumerate(extras[0]["numels"]):
        pieces = sorted(e["ranges"][i] for e in extras if i in e["ranges"])
        covered = 0
        for start, end in pieces:
            assert start == covered and end > start, f"{name}: parameter {i}: {pieces}"
            covered = end
        assert covered == numel, f"{name}: parameter {i} covered {covered} of {numel}"
    padded_share = sum(math.ceil(b / n) for b in extras[0]["buckets"])
    for rank, e in enumerate(extras):
        elements = sum(end - start for start, end in e["ranges"].values())
        assert elements <= padded_share, (name, rank)
        assert e["memory"] == {"params": e["model_bytes"], "grads": 4 * elements,
                               "optimizer_state": 8 * elements + 4 * e["shards"]}, (name, rank)  # m, v; step
        assert e["param_grads"] == 0 and e["buckets_held"] == 0, (name, rank)
        assert e["pooled"] < e["bucket_count"] or e["pooled"] == 0, (name, rank)
        assert e["pooled_bytes"] <= 2 * e["bucket_mb"] * 2**20, (name, rank)


def _assert_comm(name, per_rank):
    """Per step: every bucket's padded gradient reduced and its padded parameters gathered (G + P);
    gloo: a reduce and a broadcast per rank slice, nccl's path: one reduce-scatter and one all-gather."""
    n = len(per_rank)
    for rank, (*_, e) in enumerate(per_rank):
        padded = sum(math.ceil(b / n) * n for b in e["buckets"])
        calls = 2 * len(e["buckets"])  # one reduce-scatter and one all-gather per bucket, ring or native
        assert e["comm"]["comm_bytes"] == STEPS * 2 * 4 * padded, (name, rank)
        assert e["comm"]["collectives"] == STEPS * calls, (name, rank)
        assert 0 < e["comm"]["exposed_optimizer_comm_ms"] < e["comm"]["exposed_comm_ms"], (name, rank)


def test_state_is_sharded(two, many):
    for results, names in ((two, TWO), (many, MANY)):
        for name, per_rank in per_scenario(results, names):
            _assert_sharded(name, per_rank)


def test_comm_bytes(two, many):
    for results, names in ((two, TWO), (many, MANY)):
        for name, per_rank in per_scenario(results, names):
            _assert_comm(name, per_rank)


def test_memory_accounting_counts_dtensor_local_shards(two):
    """fully_shard's DTensors at 2 ranks: summed over ranks, every element once (39 parameters:
    4 bytes of weights, 4 of gradient, 8 of AdamW state each, plus a 4-byte step per tensor per rank)."""
    per_rank = [r["dtensor"] for r in two]
    assert sum(m["params"] for m in per_rank) == 4 * 39
    assert sum(m["grads"] for m in per_rank) == 4 * 39
    assert sum(m["optimizer_state"] for m in per_rank) == 8 * 39 + 4 * 3 * 2
    assert all(m["params"] < 4 * 39 for m in per_rank)  # each rank holds a part, not the whole


def test_unused_parameters_do_not_hang_and_match_bucketed(two):
    for rank, per_rank in enumerate(two):
        states = per_rank["unused"]
        for name in ("zero2", "zero2_native"):
            for key, tensor in states["bucketed"].items():
                torch.testing.assert_close(states[name][key], tensor, atol=1e-6, rtol=1e-5,
                                           msg=lambda m, n=name, k=key, r=rank: f"{n} rank {r} {k}: {m}")
