"""One rank of a job: `python -m ddp_lab.rank.worker JOB_DIR`, started by torchrun.

Reads the config launch.py saved in JOB_DIR (workers never run Hydra's app machinery: no second
composition, no output folder of their own), joins the process group, runs the task, and on rank 0
writes results.json. Any exception is written to JOB_DIR/errors/rank{R}.txt as one line before the
rank exits non-zero, so launch.py can say which rank failed and why.

SIGTERM (torchrun passes on the launcher's Ctrl-C or SLURM's scancel, and stops the other ranks
when one fails) raises `Terminated`, so the same path runs: the error line, and rank 0 closes its
W&B run instead of leaving it open. A rank blocked inside a collective runs no Python until the
collective returns; the launcher kills it after a grace period.
"""

from __future__ import annotations

import faulthandler
import os
import platform
import signal
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ddp_lab import jobdir
from ddp_lab.machine import resolve_backend
from ddp_lab.rank.process_group import init_from_env
from ddp_lab.rank.recorder import NullRecorder, RunRecorder
from ddp_lab.strategies.collectives import choose_collectives, collectives_in_use
from ddp_lab.strategies.comm_stats import set_per_collective
from ddp_lab.tasks import TASKS

_ALLOC = ("can't allocate memory", "cannot allocate memory", "out of memory", "std::bad_alloc")


class Terminated(BaseException):
    """Raised on SIGTERM; a BaseException, so task code that catches Exception cannot swallow it."""


assert Terminated.__name__ == jobdir.TERMINATED  # the launcher tells "stopped" from "failed" by this name


def _terminate(signum, frame):
    raise Terminated(f"stopped by {signal.Signals(signum).name} while still running")


def describe_exception(exc: BaseException) -> str:
    """One line for a rank's exception; allocation failures say 'out of memory' first."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or any(
            s in text.lower() for s in _ALLOC):
        return f"{jobdir.OOM}: {line}"
    return line


def environment(backend: str, device: torch.device) -> dict:
    """Who ran this: versions, backend, and every rank's device (gathered, so rank 0 can record it)."""
    mine = f"{socket.gethostname()}:{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
    devices = [None] * dist.get_world_size()
    dist.all_gather_object(devices, mine)
    return {"torch": torch.__version__, "python": platform.python_version(), "backend": backend,
            "collectives": collectives_in_use(), "world_size": dist.get_world_size(), "devices": devices,
            "threads_per_rank": torch.get_num_threads()}


def quiet_non_zero_ranks(job_dir: Path, rank: int) -> None:
    """Rank 0 owns the terminal (progress bar, tables); the others write to logs/rank{R}.log.

    torchrun's own stderr goes to logs/torchrun-node{N}.log (launcher/job.py), and every rank
    inherits it, so rank 0 sends its stderr to the terminal's stdout instead: its warnings stay in
    sight.
    """
    (job_dir / jobdir.LOGS).mkdir(exist_ok=True)
    if rank != 0:
        log = open(job_dir / jobdir.rank_log(rank), "a", buffering=1)
        os.dup2(log.fileno(), sys.stdout.fileno())
        os.dup2(log.fileno(), sys.stderr.fileno())
    else:
        os.dup2(sys.stdout.fileno(), sys.stderr.fileno())


def dump_stacks_on_a_fatal_signal(job_dir: Path, rank: int) -> None:
    """A rank killed by a native fault (SIGSEGV, SIGABRT: a C++ abort, heap corruption) writes every thread's
    Python stack to its log before it dies, so what it was doing is on record beside the signal the launcher names.
    The log stays open for the process's life (faulthandler writes to its descriptor)."""
    (job_dir / jobdir.LOGS).mkdir(exist_ok=True)
    faulthandler.enable(open(job_dir / jobdir.rank_log(rank), "a", buffering=1), all_threads=True)


def record_error(job_dir: Path, rank: int, exc: BaseException) -> None:
    (job_dir / jobdir.ERRORS).mkdir(exist_ok=True)
    (job_dir / jobdir.LOGS).mkdir(exist_ok=True)
    (job_dir / jobdir.error_file(rank)).write_text(describe_exception(exc) + "\n")
    with open(job_dir / jobdir.rank_log(rank), "a") as log:
        traceback.print_exc(file=log)


def main(job_dir: Path) -> None:
    rank = int(os.environ["RANK"])
    recorder = NullRecorder()
    signal.signal(signal.SIGTERM, _terminate)
    try:
        quiet_non_zero_ranks(job_dir, rank)
        dump_stacks_on_a_fatal_signal(job_dir, rank)
        cfg = OmegaConf.load(job_dir / jobdir.CONFIG)
        backend = resolve_backend(cfg.backend.name, int(os.environ["LOCAL_WORLD_SIZE"]))
        device = init_from_env(backend, cfg.backend.timeout_s)
        choose_collectives(str(cfg.backend.collectives))
        set_per_collective(bool(cfg.measure.per_collective))
        env = environment(backend, device)
        if rank == 0:
            recorder = RunRecorder(cfg, job_dir)
        result = TASKS[cfg.task.name].run(cfg, device, recorder, job_dir)
        if rank == 0:
            recorder.finish(result["summary"], ok=True)
            jobdir.write_json_atomic(job_dir / jobdir.RESULTS, jobdir.make_results(
                "ok", None, OmegaConf.to_container(cfg, resolve=True), env, result["summary"], result["steps"]))
        dist.barrier()
    except BaseException as exc:
        # torchrun SIGTERMs the other ranks as soon as one fails: let this one record and close first.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        record_error(job_dir, rank, exc)
        recorder.finish(None, ok=False)
        os._exit(1)  # skip the process-group teardown, which would wait on the failed collectives
    dist.destroy_process_group()
    # Skip interpreter finalization too: gloo's threads may still hold tensors, and freeing them while
    # the interpreter is torn down can abort (SIGABRT) a rank of a job that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
