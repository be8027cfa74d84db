"""ddp_lab used as a library, the way a CS336-style test harness calls it, many times: does every rank end clean?

    python benchmarks/teardown_cs336.py --runs 200           # rotating the wrappers below, one per run
    python benchmarks/teardown_cs336.py --runs 40 --wrappers overlap

Each run is what such a harness does: `torch.multiprocessing.spawn` two ranks; each joins a gloo
process group (`init_process_group` over MASTER_ADDR / MASTER_PORT), builds the same small model
(its own `Linear` class and torch's), wraps it, trains a few steps with AdamW (forward, backward,
`finish_gradient_synchronization()`, step), calls `barrier()` and `destroy_process_group()`, and
returns, so the rank's interpreter finalizes as usual (no `os._exit`). A run is clean when both
ranks exit 0; a rank that aborts at interpreter teardown (`terminate called without an active
exception`, SIGABRT after the training passed) or fails otherwise is counted by wrapper.

Wrappers (rotated, run i takes the (i mod 7)-th): naive, flat, overlap, bucketed (a bucket smaller
than a parameter), fsdp, ShardedOptimizer (over NaiveDDP), and `course_overlap`: the course's own
test as it runs OverlapDDP, in its own order of calls (a barrier after joining; the model built, then
a deep copy of it wrapped; a model with a tied weight; SGD; each of 5 iterations zeroes the
gradients, trains the single-process model on the whole batch, then the wrapped one on this rank's
share, synchronizes, steps and compares every parameter; then a barrier and
`destroy_process_group()`). torch's optimizer built after `init_process_group` already keeps the
group alive past `destroy_process_group()` (see docs/benchmarks.md, "Ranks that abort at exit"), as
it does in every such harness.
"""

from __future__ import annotations

import argparse
import collections
import socket
import time

import torch
import torch.distributed as dist
from teardown_repro import spawn_ending  # benchmarks/, beside this script
from torch import nn

WRAPPERS = ("naive", "flat", "overlap", "bucketed", "fsdp", "sharded_optimizer", "course_overlap")


class OwnLinear(nn.Module):
    """A student's own linear layer (not a subclass of nn.Linear)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)

    def forward(self, x):
        return x @ self.weight.T


def build(wrapper: str):
    from ddp_lab.strategies import FSDP, BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP, ShardedOptimizer

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), OwnLinear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    if wrapper == "sharded_optimizer":
        ddp = NaiveDDP(model)
        return ddp, ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-3)
    ddp = {"naive": NaiveDDP, "flat": FlatDDP, "overlap": OverlapDDP, "fsdp": FSDP,
           "bucketed": lambda m: BucketedDDP(m, bucket_mb=0.001)}[wrapper](model)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)


class TiedToy(nn.Module):
    """The course's toy model with a tied weight: two layers share one matrix."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10, bias=False)
        self.fc2 = nn.Linear(10, 10)
        self.fc3 = nn.Linear(10, 5)
        self.fc2.weight = self.fc1.weight

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def course_overlap(rank: int, world_size: int, steps: int) -> None:
    """The course's OverlapDDP test body, in its order of calls (module docstring)."""
    from copy import deepcopy

    from ddp_lab.strategies import OverlapDDP

    dist.barrier()
    torch.manual_seed(rank)
    single = TiedToy()
    ddp = OverlapDDP(deepcopy(single))
    xs = torch.randn(20, 10, generator=torch.Generator().manual_seed(0))
    ys = torch.randn(20, 5, generator=torch.Generator().manual_seed(1))
    loss_fn = nn.MSELoss()
    single.load_state_dict(ddp.module.state_dict())  # rank 0's weights, as the course's test compares from
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    single_optimizer = torch.optim.SGD(single.parameters(), lr=0.1)
    share = slice(rank * 10, rank * 10 + 10)
    for _ in range(max(steps, 5)):
        ddp_optimizer.zero_grad()
        single_optimizer.zero_grad()
        loss_fn(single(xs), ys).backward()
        single_optimizer.step()
        loss_fn(ddp(xs[share]), ys[share]).backward()
        ddp.finish_gradient_synchronization()
        ddp_optimizer.step()
        for a, b in zip(single.parameters(), ddp.parameters()):
            assert torch.allclose(a, b, atol=1e-6), "the wrapped model left the single-process one"
    dist.barrier()
    dist.destroy_process_group()


def rank_main(rank: int, world_size: int, port: int, wrapper: str, steps: int) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    if wrapper == "course_overlap":
        course_overlap(rank, world_size, steps)
        return
    torch.manual_seed(rank)  # different init per rank: the wrapper broadcasts rank 0's
    ddp, optimizer = build(wrapper)
    data = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    target = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(1))
    share = slice(rank * 4, rank * 4 + 4)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(data[share]), target[share])
        loss.backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(wrapper: str, steps: int, world_size: int = 2) -> str:
    """'ok', or how the run ended (teardown_repro.spawn_ending)."""
    return spawn_ending(rank_main, (world_size, free_port(), wrapper, steps), world_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--wrappers", default=",".join(WRAPPERS), help=f"comma-separated, of {', '.join(WRAPPERS)}")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    wrappers = [w for w in args.wrappers.split(",") if w]
    unknown = sorted(set(wrappers) - set(WRAPPERS))
    if unknown:
        parser.error(f"unknown wrapper {unknown[0]!r}: use {', '.join(WRAPPERS)}")
    endings: dict[str, collections.Counter] = {w: collections.Counter() for w in wrappers}
    start = time.perf_counter()
    for i in range(args.runs):
        wrapper = wrappers[i % len(wrappers)]
        endings[wrapper][one_run(wrapper, args.steps)] += 1
    bad = sum(n for c in endings.values() for how, n in c.items() if how != "ok")
    print(f"torch {torch.__version__}: {args.runs - bad}/{args.runs} runs ended clean in "
          f"{time.perf_counter() - start:.0f} s")
    for wrapper, counts in endings.items():
        print(f"  {wrapper}: {dict(counts)}")


if __name__ == "__main__":
    main()
