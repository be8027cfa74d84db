"""Run a function on N gloo ranks in fresh processes and collect what each rank returns.

Ranks rendezvous through a FileStore in a temporary folder, so tests need no port and never
collide with each other or with a sweep running beside them. The function must be importable
(module level), since ranks are started with the `spawn` method.

A rank that succeeded ends with `os._exit(0)` once its result is saved and the group destroyed, as
the worker does and as `multiprocessing`'s fork start method always does: gloo's threads can still
be dropping tensors when the interpreter finalizes, and that aborts the rank (SIGABRT, `terminate
called without an active exception`) after everything passed. benchmarks/teardown_repro.py shows it
with torch alone; benchmarks/teardown_repeat.py repeats this harness to count it.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GLOO_TIMEOUT_S = 60


def _entry(rank: int, world_size: int, store_path: str, out_dir: str, fn, args, finalize: bool) -> None:
    torch.set_num_threads(1)  # 2 to 4 ranks share 2 cores: oversubscription makes tests crawl
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    if not finalize:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_ranks(fn, world_size: int, *args, finalize: bool = False) -> list:
    """Call `fn(rank, world_size, *args)` on every rank; return the ranks' results in rank order.

    `finalize=True` lets a successful rank's interpreter finalize (the teardown benchmark's control).
    """
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        try:
            mp.start_processes(_entry, args=(world_size, store_path, tmp, fn, args, finalize),
                               nprocs=world_size, start_method="spawn")
        except mp.ProcessRaisedException:
            errors = [open(os.path.join(tmp, name)).read() for name in sorted(os.listdir(tmp)) if name.endswith(".err")]
            raise AssertionError("a rank failed:\n" + "\n".join(errors)) from None
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def ranks_fixture(fn, world_size: int, *args):
    """A module-scoped fixture holding `run_ranks(fn, world_size, *args)`: one set of rank processes
    (the slow part) for every test of a file that reads it."""

    @pytest.fixture(scope="module")
    def results():
        return run_ranks(fn, world_size, *args)

    return results
