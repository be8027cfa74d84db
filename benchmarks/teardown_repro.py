"""Minimal reproducer, no ddp_lab code: gloo's worker thread aborting a spawned rank at exit.

    python benchmarks/teardown_repro.py --runs 40 --scenario unwaited --pin
    python benchmarks/teardown_repro.py --runs 40 --scenario unwaited --pin --skip-finalize

Each run spawns 2 gloo ranks (torch.multiprocessing, `spawn`), does a few all-reduces, calls
`destroy_process_group()` and returns, so the rank's interpreter finalizes. When one of gloo's
`pt_gloo_runloop` threads drops the last reference to a tensor whose Python object torch keeps
alive, it must take the GIL to free it; during `Py_FinalizeEx` taking the GIL ends the thread with
`pthread_exit`, whose forced unwind runs through a `noexcept` frame: `terminate called without an
active exception`, SIGABRT. Scenarios:

- `waited`: every async op waited for, every reference dropped (what a correct program does);
  the thread still releases its own references after it marks the work done, a small race window.
- `unwaited`: the last async all-reduce is not waited for and its tensor is dropped at once, so the
  gloo thread holds the last reference: the race made wide.

`--pin` keeps the process group alive past `destroy_process_group()`, as any object holding it
does (here the default arguments `group=group.WORLD` of torch.distributed.nn.functional, imported
after the group exists); without it the group's destructor joins gloo's threads before teardown.

`--skip-finalize` ends each rank with `os._exit(0)` after `destroy_process_group()` (what
`multiprocessing`'s fork start method does anyway), so no thread can meet a finalizing interpreter.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, world_size: int, store_path: str, scenario: str, skip_finalize: bool, pin: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    if pin:  # first imported now, its default arguments `group=group.WORLD` keep the group alive to the end
        importlib.import_module("torch.distributed.nn.functional")
    for _ in range(5):
        tensors = [torch.randn(1 << 16) for _ in range(4)]
        works = [dist.all_reduce(t, async_op=True) for t in tensors]
        for work in works:
            work.wait()
        del tensors, works
    if scenario == "unwaited":
        dist.all_reduce(torch.randn(1 << 20), async_op=True)  # neither the work nor the tensor kept
    dist.barrier()
    dist.destroy_process_group()
    if skip_finalize:
        os._exit(0)


def spawn_ending(fn, args: tuple, nprocs: int) -> str:
    """Spawn `fn(rank, *args)` on `nprocs` ranks; 'ok', or how the run ended ('SIGABRT in rank 1',
    'exception in rank 0: ...'). teardown_cs336.py counts its runs with it too."""
    try:
        mp.start_processes(fn, args=args, nprocs=nprocs, start_method="spawn")
    except mp.ProcessExitedException as exc:
        return f"{exc.signal_name or f'exit {exc.exit_code}'} in rank {exc.error_index}"
    except mp.ProcessRaisedException as exc:
        return f"exception in rank {exc.error_index}: {str(exc).strip().splitlines()[-1]}"
    return "ok"


def one_run(scenario: str, skip_finalize: bool, pin: bool, world_size: int = 2) -> str:
    """'ok', or how the run ended (`spawn_ending`)."""
    with tempfile.TemporaryDirectory() as tmp:
        return spawn_ending(rank_main, (world_size, os.path.join(tmp, "store"), scenario, skip_finalize, pin),
                            world_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--scenario", choices=["waited", "unwaited"], default="unwaited")
    parser.add_argument("--skip-finalize", action="store_true")
    parser.add_argument("--pin", action="store_true", help="import torch.distributed.nn.functional after init")
    args = parser.parse_args()
    endings: collections.Counter[str] = collections.Counter()
    start = time.perf_counter()
    for _ in range(args.runs):
        endings[one_run(args.scenario, args.skip_finalize, args.pin)] += 1
    failed = args.runs - endings["ok"]
    print(f"scenario={args.scenario} skip_finalize={args.skip_finalize} pin={args.pin} torch={torch.__version__}: "
          f"{failed}/{args.runs} runs aborted ({dict(endings)}) in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
