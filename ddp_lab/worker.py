"""One rank of a job: `python -m ddp_lab.worker JOB_DIR`, started by torchrun.

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

from ddp_lab.distributed import init_from_env, resolve_backend
from ddp_lab.failures import ERRORS, TERMINATED, describe_exception
from ddp_lab.results import CONFIG, RESULTS, make_results, write_json_atomic
from ddp_lab.run_recorder import NullRecorder, RunRecorder

LOGS = "logs"


class Terminated(BaseException):
    """Raised on SIGTERM; a BaseException, so task code that catches Exception cannot swallow it."""


assert Terminated.__name__ == TERMINATED  # failures.py tells "stopped" from "failed" by this name


def _terminate(signum, frame):
    raise Terminated(f"stopped by {signal.Signals(signum).name} while still running")


def task_runner(name: str):
    if name == "train":
        from ddp_lab.tasks.train import run
    elif name == "allreduce":
        from ddp_lab.tasks.allreduce import run
    else:
        raise ValueError(f"unknown task '{name}'")
    return run


def environment(backend: str, device: torch.device) -> dict:
    """Who ran this: versions, backend, and every rank's device (gathered, so rank 0 can record it)."""
    mine = f"{socket.gethostname()}:{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
    devices = [None] * dist.get_world_size()
    dist.all_gather_object(devices, mine)
    return {"torch": torch.__version__, "python": platform.python_version(), "backend": backend,
            "world_size": dist.get_world_size(), "devices": devices, "threads_per_rank": torch.get_num_threads()}


def quiet_non_zero_ranks(job_dir: Path, rank: int) -> None:
    """Rank 0 owns the terminal (progress bar, tables); the others write to logs/rank{R}.log.

    torchrun's own stderr goes to logs/torchrun-node{N}.log (job.py), and every rank inherits it, so
    rank 0 sends its stderr to the terminal's stdout instead: its warnings stay in sight.
    """
    log_dir = job_dir / LOGS
    log_dir.mkdir(exist_ok=True)
    if rank != 0:
        log = open(log_dir / f"rank{rank}.log", "a", buffering=1)
        os.dup2(log.fileno(), sys.stdout.fileno())
        os.dup2(log.fileno(), sys.stderr.fileno())
    else:
        os.dup2(sys.stdout.fileno(), sys.stderr.fileno())


def record_error(job_dir: Path, rank: int, exc: BaseException) -> None:
    (job_dir / ERRORS).mkdir(exist_ok=True)
    (job_dir / LOGS).mkdir(exist_ok=True)
    (job_dir / ERRORS / f"rank{rank}.txt").write_text(describe_exception(exc) + "\n")
    with open(job_dir / LOGS / f"rank{rank}.log", "a") as log:
        traceback.print_exc(file=log)


def main(job_dir: Path) -> None:
    rank = int(os.environ["RANK"])
    recorder = NullRecorder()
    signal.signal(signal.SIGTERM, _terminate)
    try:
        quiet_non_zero_ranks(job_dir, rank)
        cfg = OmegaConf.load(job_dir / CONFIG)
        backend = resolve_backend(cfg.backend.name, int(os.environ["LOCAL_WORLD_SIZE"]))
        device = init_from_env(backend, cfg.backend.timeout_s)
        env = environment(backend, device)
        if rank == 0:
            recorder = RunRecorder(cfg, job_dir)
        result = task_runner(cfg.task.name)(cfg, device, recorder, job_dir)
        if rank == 0:
            recorder.finish(result["summary"], ok=True)
            write_json_atomic(job_dir / RESULTS, make_results(
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
