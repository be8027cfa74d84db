"""No strategy keeps the process group alive once its wrapper is gone.

A process group that outlives `destroy_process_group()` keeps gloo's threads running into
interpreter teardown, where freeing a tensor from one of them aborts the rank (see
benchmarks/teardown_repro.py). torch_ddp and zero1_torch used to: their gradient-time hook was a
bound method, closing a cycle through DDP's C++ reducer that the garbage collector cannot see.

torch itself takes references to the group once per process, the first time a strategy uses a
part of it (DTensor under fsdp_torch's FSDP2; a torch module imported after the group exists keeps
it in its functions' default arguments), and keeps them even past `destroy_process_group()`:
torch's own state, not a wrapper's (a second run of the same strategy adds none). So every strategy
runs once before the count, and the count is of a second run: what a wrapper leaves behind shows
there as it would in the first.
"""

from __future__ import annotations

import gc
import sys

import torch.distributed as dist

from ddp_lab.check.parity import train_distributed
from ddp_lab.check.ranks import run_ranks
from ddp_lab.spec.strategies import SPECS
from tests.helpers.extras import runnable_specs


def _maker(name: str):
    """The strategy as its spec builds it, with a bucket smaller than every parameter where it has buckets."""
    spec = SPECS[name]()
    if "bucket_mb" in spec.used_knobs():
        spec.bucket_mb = 0.001
    return spec.build


def _extra_group_references(rank: int, world_size: int) -> dict[str, int]:
    group = dist.group.WORLD
    makers = {name: _maker(name) for name in runnable_specs()}
    for make in makers.values():  # torch's one-time state (module docstring)
        train_distributed(rank, world_size, make, "tied", steps=1)
    extra = {}
    for name, make in makers.items():
        gc.collect()
        before = sys.getrefcount(group)
        train_distributed(rank, world_size, make, "tied", steps=2)
        gc.collect()
        extra[name] = sys.getrefcount(group) - before
    return extra


# DeepSpeed's ZeRO-3 engine outlives its strategy (test_memory_census.py) and with it its references to the
# group; recorded so that a fix shows
KEEPS_THE_GROUP = {"deepspeed_zero3"}


def test_no_strategy_keeps_the_process_group_alive():
    for extra in run_ranks(_extra_group_references, 2):
        assert {k: v for k, v in extra.items() if k not in KEEPS_THE_GROUP} == \
            dict.fromkeys(set(runnable_specs()) - KEEPS_THE_GROUP, 0)
        kept = {k: extra[k] for k in KEEPS_THE_GROUP if k in extra}
        assert all(v > 0 for v in kept.values()), f"{kept}: drop what lets the group go from KEEPS_THE_GROUP"
