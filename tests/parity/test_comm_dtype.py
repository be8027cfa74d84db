"""`strategy.comm_dtype`: every gradient-reducing strategy moves half the bytes in bf16 and fp16, and
the average it delivers is the exact one to that dtype's rounding; fp16 near its maximum does not
overflow.

The model makes each gradient exactly what the test chose: parameters `w_i`, zero at the start,
loss = sum_i <w_i, x_i>, so rank r's gradient of `w_i` is its own `x_i`. One SGD step with lr 1
then leaves `-average` in every parameter on every rank, sharded strategies included (their
updated shards are gathered): the delivered average is read the same way for every strategy.
Bytes are the step's gradient collectives only (popped right after the sync, before the
optimizer's parameter traffic).
"""

from __future__ import annotations

import functools
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.check.ranks import run_ranks
from ddp_lab.strategies import (
    BucketedDDP,
    FlatDDP,
    NaiveDDP,
    OverlapDDP,
    PowerSGD,
    TorchDDP,
    TorchFSDP,
    Zero1,
    Zero2,
)

SIZES = (7, 33, 100, 5)  # odd sizes: zero2 pads its buckets, zero1 owners get unequal shares
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ChosenGrads(nn.Module):
    def __init__(self):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.zeros(n)) for n in SIZES])

    def forward(self, xs):
        return sum((w * x).sum() for w, x in zip(self.ws, xs))


class _Chosen(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n, 1))

    def forward(self, x):
        return (self.weight * x.view(-1, 1)).sum()


class ChosenMatrices(nn.Module):
    """ChosenGrads with each w_i an (n, 1) matrix in a leaf layer of its own: units fsdp's policy shards."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Chosen(n) for n in SIZES)

    @property
    def ws(self):
        return [layer.weight for layer in self.layers]

    def forward(self, xs):
        return sum(layer(x) for layer, x in zip(self.layers, xs))


class Zero2Native(Zero2):
    collectives = "native"  # gloo's own reduce_scatter_single (nccl's call); Zero2 runs the lab's rings


STRATEGIES = {
    "naive": NaiveDDP,
    "flat": FlatDDP,
    "overlap": OverlapDDP,
    "bucketed": partial(BucketedDDP, bucket_mb=200 / 2**20),  # two buckets
    "zero1": partial(Zero1, bucket_mb=200 / 2**20),
    "zero1_reduce_scatter": partial(Zero1, comm="reduce_scatter"),
    "zero1_reduce_scatter_native": partial(Zero1, comm="reduce_scatter"),
    "zero2": partial(Zero2, bucket_mb=200 / 2**20),
    "zero2_native": partial(Zero2Native, bucket_mb=200 / 2**20),
    "torch_ddp": partial(TorchDDP, bucket_mb=200 / 2**20),
    "powersgd": partial(PowerSGD, bucket_mb=200 / 2**20, start_iter=0),  # 1-D tensors: sent exactly, in the dtype
    "fsdp_torch": partial(TorchFSDP, reshard_after_forward=False),  # reduce_dtype; one gather per unit
}
MODEL = {"fsdp_torch": ChosenMatrices}  # the others: ChosenGrads
PADDED = {"zero2", "zero2_native", "zero1_reduce_scatter_native", "fsdp_torch"}  # shards padded to N
NOT_ON_GLOO = {("torch_ddp", "bf16")}  # torch's bf16 hook wants CUDA + NCCL: refused before launch


def grads_of(rank: int, scale: float) -> list[torch.Tensor]:
    """Rank r's gradients: magnitudes in [scale, 2 scale), its own; signs the same on every rank."""
    signs, g = torch.Generator().manual_seed(7), torch.Generator().manual_seed(100 + rank)
    return [scale * (1 + torch.rand(n, generator=g)) * torch.randn(n, generator=signs).sign() for n in SIZES]


def _deliver(rank, world_size, scale):
    out = {}
    for name, make in STRATEGIES.items():
        for dtype in DTYPES:
            if (name, dtype) in NOT_ON_GLOO:
                continue
            torch.manual_seed(rank)
            wrapper = make(MODEL.get(name, ChosenGrads)(), comm_dtype=dtype)
            optimizer = wrapper.make_optimizer(torch.optim.SGD, lr=1.0)
            if name.endswith("_native") and name.startswith("zero1"):
                optimizer.collectives = "native"  # equal rows: owners' segments padded (the ring's are exact)
            optimizer.zero_grad()
            wrapper([x.clone() for x in grads_of(rank, scale)]).backward()
            wrapper.finish_gradient_synchronization()
            comm = wrapper.comm.pop()
            optimizer.step()
            out[name, dtype] = ([-_whole(w) for w in wrapper.module.ws], comm["comm_bytes"])
            if isinstance(wrapper, TorchFSDP):
                out[name, "gradient bytes"] = _padded_bytes(wrapper)
    return out


def _padded_bytes(wrapper) -> int:
    """fsdp_torch's fp32 gradient bytes, padded as its shards are."""
    n = dist.get_world_size()
    return sum(-(-p.shape[0] // n) * n * (p.numel() // p.shape[0]) * p.element_size()
               for p in wrapper.module.parameters())


def _gradient_bytes(rank_results: dict) -> dict:
    """Each (strategy, dtype)'s gradient bytes: comm_bytes, less fsdp_torch's parameter all-gathers
    (fp32 whatever comm_dtype: the fp32 run's bytes beyond its padded gradient)."""
    out = {}
    for key, value in rank_results.items():
        if key[1] in DTYPES:
            padded = rank_results.get((key[0], "gradient bytes"))
            gathers = 0 if padded is None else rank_results[key[0], "fp32"][1] - padded
            out[key] = (value[0], value[1] - gathers)
    return out


def _whole(param) -> torch.Tensor:
    """The parameter on this rank, whole (fsdp_torch's are DTensor shards)."""
    full = getattr(param, "full_tensor", None)
    return (full() if full is not None else param).detach().reshape(-1).clone()


def _torch_refuses_bf16_hook(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(nn.Linear(4, 4))
    try:
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    except TypeError as exc:
        return str(exc)
    return None


def _check(results, world_size, scale):
    exact = [sum(grads_of(r, scale)[i].double() for r in range(world_size)) / world_size for i in range(len(SIZES))]
    total = [sum(grads_of(r, scale)[i].double().abs() for r in range(world_size)) / world_size
             for i in range(len(SIZES))]
    grad_bytes = 4 * sum(SIZES)
    for rank_results in map(_gradient_bytes, results):
        for (name, dtype), (delivered, nbytes) in rank_results.items():
            padded = name in PADDED
            if dtype == "fp32":
                assert nbytes >= grad_bytes and (padded or nbytes == grad_bytes), (name, nbytes)
            else:
                assert 2 * nbytes == rank_results[name, "fp32"][1], (name, dtype, nbytes)
            eps = torch.finfo(DTYPES[dtype]).eps
            for got, want, size in zip(delivered, exact, total):
                assert got.dtype == torch.float32 and torch.isfinite(got).all(), (name, dtype)
                # one rounding of each rank's share and one per addition: at most N roundings of the sum
                bound = world_size * eps * size + 1e-30
                err = (got.double() - want).abs()
                assert (err <= bound).all(), (name, dtype, (err / size).max().item())
            if dtype != "fp32":  # the cast really happened: the fp32 answer is not what arrived
                assert any(not torch.equal(a, b) for a, b in zip(delivered, rank_results[name, "fp32"][0])), name


LARGE = 30000.0  # every rank's gradient 30000-60000, one sign per element: summed first, fp16 would be inf


def _everything(rank, world_size):
    """One process start per world size (it costs more than the checks)."""
    out = {"unit": _deliver(rank, world_size, 1.0)}
    if world_size == 2:
        out["large"] = _deliver(rank, world_size, LARGE)
        out["bf16_hook"] = _torch_refuses_bf16_hook(rank, world_size)
    return out


@functools.lru_cache(maxsize=None)
def ranks(world_size):
    return run_ranks(_everything, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_half_the_bytes_and_the_average_to_the_dtype_rounding(world_size):
    _check([r["unit"] for r in ranks(world_size)], world_size, 1.0)


def test_fp16_near_its_maximum_does_not_overflow():
    assert 2 * LARGE * 2 > torch.finfo(torch.float16).max
    _check([r["large"] for r in ranks(2)], 2, LARGE)


def test_torch_refuses_its_bf16_hook_on_gloo():
    """Why validate.py refuses strategy=torch_ddp strategy.comm_dtype=bf16 on gloo."""
    messages = [r["bf16_hook"] for r in ranks(2)]
    assert all(m is not None and "NCCL" in m for m in messages), messages
