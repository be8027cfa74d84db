"""Run a function on N gloo ranks in fresh processes and collect what each rank returns.

Ranks rendezvous through a FileStore in a temporary folder, so runs need no port and never collide
with each other or with a sweep running beside them. The function must be importable (module
level): ranks are forked from a fork server that has imported torch once (`check/fork_server.py`), so a
rank starts in milliseconds instead of paying torch's imports again (about 6 s of CPU a rank here); every
later call of the process forks from the same server, which keeps the environment variables of the first
call. The conformance check and the parity tests both run their ranks here.

A rank that succeeded ends with `os._exit(0)` once its result is saved and the group destroyed, as
the worker does and as `multiprocessing`'s fork start method always does: gloo's threads can still
be dropping tensors when the interpreter finalizes, and that aborts the rank (SIGABRT, `terminate
called without an active exception`) after everything passed. benchmarks/teardown_repro.py shows it
with torch alone; benchmarks/teardown_repeat.py repeats this harness to count it.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_lab.jobdir import write_text_atomic

GLOO_TIMEOUT_S = 60
PRELOAD = ["ddp_lab.check.fork_server"]


class RanksFailed(AssertionError):
    """A rank raised (`errors`: each failed rank's traceback, `failed_ranks`: which ranks, in the same order)
    or the ranks ran past their deadline."""

    def __init__(self, message: str, errors: list[str], failed_ranks: list[int] | None = None,
                 timed_out: bool = False):
        super().__init__(message)
        self.errors, self.failed_ranks, self.timed_out = errors, failed_ranks or [], timed_out


def _entry(rank: int, world_size: int, store_path: str, out_dir: str, fn, args, finalize: bool,
           log_dir: str | None = None) -> None:
    if log_dir is not None:  # the rank's prints and warnings, apart from its caller's output
        log = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log, 1)
        os.dup2(log, 2)
    # a rank that dies of a signal (a native abort: SIGABRT, SIGSEGV) prints every thread's Python stack first
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)  # 2 to 5 ranks share 2 cores: oversubscription makes them crawl
    try:  # joining the group inside: a rank that dies joining (a bad GLOO_SOCKET_IFNAME) says so, not a hang
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=GLOO_TIMEOUT_S))
        # every rank has joined before any runs `fn`: a rank whose work needs no collective (a case its layers
        # refused when built) would otherwise end, and close its connections, while a peer still completes gloo's
        # full mesh, which then dies "joining" (seen once in CI under load: the verdict blamed the wrong rank)
        dist.barrier()
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        # whole or not at all: once one rank has raised, torch's spawn context kills the others, perhaps mid-write,
        # and an empty rank0.err read as rank 0's error said "rank 0 raised an exception" where rank 1's own error
        # said why (seen once in CI under load)
        write_text_atomic(os.path.join(out_dir, f"rank{rank}.err"), traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if not finalize:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _start_method(finalize: bool) -> str:
    """forkserver, preloaded; spawn where a rank must finalize its interpreter (a forked process ends by
    `os._exit`, whatever the function does) or where there is no fork server (Windows)."""
    if finalize or "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)  # once the server runs: ignored
    return "forkserver"


@contextmanager
def _spawn_log_to(log_dir: str | None):
    """With `log_dir`, torch's spawn logger ("Terminating process N via signal SIGTERM" when a rank fails)
    writes to `spawn.log` there instead of the caller's stderr, where it would fall among the verdict lines."""
    if log_dir is None:
        yield
        return
    logger = logging.getLogger("torch.multiprocessing.spawn")
    handler, propagate = logging.FileHandler(os.path.join(log_dir, "spawn.log")), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        handler.close()


def _log_sizes(log_dir: str | None, world_size: int) -> dict[int, int]:
    if log_dir is None:
        return {}
    paths = {rank: os.path.join(log_dir, f"rank{rank}.log") for rank in range(world_size)}
    return {rank: os.path.getsize(path) if os.path.exists(path) else 0 for rank, path in paths.items()}


def _last_words(log_dir: str | None, rank: int, logged: dict[int, int]) -> str | None:
    """The `what():` line the C++ runtime printed as it terminated `rank` in this run (gloo's "Received data size
    doesn't match expected size", say), from the part of its log this run wrote; None where there is none."""
    if log_dir is None or rank not in logged:
        return None
    with open(os.path.join(log_dir, f"rank{rank}.log"), "rb") as log:
        log.seek(logged[rank])
        lines = log.read().decode(errors="replace").splitlines()
    said = [line.strip().removeprefix("what():").strip() for line in lines if line.strip().startswith("what():")]
    return said[-1] if said else None


RAISE_SETTLE_S = 3.0
"""After the first rank raised, how long the others may take to end and write their own error: the rank whose peer
died often raises first, and the cause is the peer's."""


def run_ranks(fn, world_size: int, *args, finalize: bool = False, timeout_s: float | None = None,
              log_dir: str | None = None) -> list:
    """Call `fn(rank, world_size, *args)` on every rank; return the ranks' results in rank order.

    A rank that raises, or ranks still running after `timeout_s` (then every rank is killed), raise
    `RanksFailed`; a rank that dies without raising (a signal, an exit code) raises torch's
    `ProcessExitedException`, which names how it ended, with `last_words`: what the C++ runtime said as it aborted
    the rank (gloo's enforce, in its log of this run; None without one). `finalize=True` lets a successful rank's
    interpreter finalize (the teardown benchmark's control). `log_dir`: each rank's stdout and stderr go to
    `rank{R}.log` there (appended), not to the caller's.
    """
    with tempfile.TemporaryDirectory() as tmp, _spawn_log_to(log_dir):
        logged = _log_sizes(log_dir, world_size)  # where this run's lines start in each rank's (appended) log
        store_path = os.path.join(tmp, "store")
        context = mp.start_processes(_entry, args=(world_size, store_path, tmp, fn, args, finalize, log_dir),
                                     nprocs=world_size, start_method=_start_method(finalize), join=False)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while not context.join(timeout=1):
                if deadline is not None and time.monotonic() > deadline:
                    raise RanksFailed(f"the ranks were still running after {timeout_s:g} s", [], timed_out=True)
        except mp.ProcessRaisedException:
            settle = time.monotonic() + RAISE_SETTLE_S  # a peer's own error may still be on its way to its file
            for process in context.processes:
                process.join(timeout=max(0.0, settle - time.monotonic()))
            failed = sorted(int(name[4:-4]) for name in os.listdir(tmp) if name.endswith(".err"))
            errors = [open(os.path.join(tmp, f"rank{r}.err")).read() for r in failed]
            raise RanksFailed("a rank failed:\n" + "\n".join(errors), errors, failed) from None
        except mp.ProcessExitedException as exc:
            exc.last_words = _last_words(log_dir, exc.error_index, logged)
            raise
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
