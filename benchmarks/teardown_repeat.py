"""Repeat the test harness's distributed runs and count ranks that abort at exit.

    python benchmarks/teardown_repeat.py --runs 100                 # the harness as the suite uses it
    python benchmarks/teardown_repeat.py --runs 100 --finalize      # successful ranks finalize (the control)

Each run is one `ddp_lab.check.ranks.run_ranks` call on 2 gloo ranks, as the parity tests
make it: every strategy named trains the frozen-parameter and the tied-weight models for a few
steps from different per-rank inits, and returns its state dict. A run passes when every rank ends
with status 0; an abort at interpreter teardown (SIGABRT after the training passed) counts as a
failure. It also checks, in every run, that no strategy keeps the process group alive once the
wrapper is gone (that is what made torch_ddp and zero1_torch pin gloo's threads into teardown).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import inspect
import sys
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_lab.check.parity import train_distributed
from ddp_lab.check.ranks import run_ranks
from ddp_lab.spec.strategies import SPECS


def train_every_strategy(rank: int, world_size: int, names: list[str]) -> dict:
    """Per strategy: how many more references the process group has after training than before."""
    group = dist.group.WORLD
    before = sys.getrefcount(group)
    pinned = {}
    for name in names:
        runtime = SPECS[name].runtime_class()
        knobs = {"bucket_mb": 0.001} if "bucket_mb" in inspect.signature(runtime).parameters else {}
        for model in ("frozen", "tied"):
            train_distributed(rank, world_size, functools.partial(runtime, **knobs), model)
        gc.collect()
        pinned[name] = sys.getrefcount(group) - before
    return pinned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--strategies", default="naive,overlap,bucketed,torch_ddp")
    parser.add_argument("--finalize", action="store_true", help="let successful ranks finalize (no os._exit)")
    args = parser.parse_args()
    names = args.strategies.split(",")
    endings: collections.Counter[str] = collections.Counter()
    pins: collections.Counter[str] = collections.Counter()
    start = time.perf_counter()
    for _ in range(args.runs):
        try:
            for pinned in run_ranks(train_every_strategy, 2, names, finalize=args.finalize):
                pins.update({name: 1 for name, extra in pinned.items() if extra})
            endings["ok"] += 1
        except mp.ProcessExitedException as exc:
            endings[f"rank {exc.error_index} {exc.signal_name or f'exit {exc.exit_code}'}"] += 1
        except AssertionError:
            endings["a rank raised"] += 1
    print(f"strategies={args.strategies} finalize={args.finalize}: {args.runs - endings['ok']}/{args.runs} runs "
          f"failed {dict(endings)}; rank-runs whose strategies kept the group alive: {dict(pins) or 'none'} "
          f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
