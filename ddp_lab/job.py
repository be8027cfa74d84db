"""Run one job's ranks with torchrun as a child process and map its end to a status.

launch.py (one process per sweep job) calls `run_job`. torchrun is started in a session of its
own, so the launcher alone decides when to stop it: on Ctrl-C or SIGTERM it sends SIGTERM to
torchrun's whole process group (torchrun stops its workers), waits, then kills what is left.
Nothing this job started outlives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig

from ddp_lab.results import RESULTS, make_results, read_results, read_steps, write_json_atomic
from ddp_lab.worker import ERRORS

GRACE_S = 10
REPO_ROOT = Path(__file__).resolve().parents[1]


class Interrupted(Exception):
    pass


def torchrun_command(cfg: DictConfig, job_dir: Path) -> list[str]:
    """`python -m torch.distributed.run ... -m ddp_lab.worker JOB_DIR`: torchrun's own rendezvous."""
    launcher = cfg.launcher
    nproc = cfg.world_size // launcher.nnodes
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--max-restarts=0",
           "--monitor-interval=0.2"]
    if launcher.nnodes == 1:
        cmd.append("--standalone")  # c10d rendezvous on a free port of this machine: sweeps never collide
    else:
        cmd += [f"--nnodes={launcher.nnodes}", f"--node-rank={launcher.node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={launcher.rdzv_endpoint}", f"--rdzv-id={launcher.rdzv_id or 'ddp-lab'}"]
    return cmd + ["-m", "ddp_lab.worker", str(job_dir)]


def worker_env(cfg: DictConfig) -> dict:
    env = dict(os.environ)
    local_ranks = cfg.world_size // cfg.launcher.nnodes
    # torchrun would set 1 and warn; share this machine's cores among its ranks instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // local_ranks)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Workers import ddp_lab from this checkout even when it is not pip-installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def _stop(child: subprocess.Popen) -> None:
    """SIGTERM torchrun's process group, then SIGKILL whatever is still there after a grace period."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 5)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _first_rank_error(job_dir: Path) -> str | None:
    """The earliest rank error: the root cause (later ranks usually fail on the broken collective)."""
    errors = sorted((job_dir / ERRORS).glob("rank*.txt"), key=lambda p: p.stat().st_mtime) if (job_dir / ERRORS).exists() else []
    if not errors:
        return None
    first = errors[0]
    return f"{first.stem.replace('rank', 'rank ')}: {first.read_text().strip()}"


def run_job(cfg: DictConfig, job_dir: Path) -> dict:
    """Start the ranks, wait, and return the job's results (also written to JOB_DIR/results.json)."""
    child = subprocess.Popen(torchrun_command(cfg, job_dir), env=worker_env(cfg), start_new_session=True)
    interrupted = False
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        returncode = child.wait()
    except (KeyboardInterrupt, Interrupted):
        interrupted = True
        _stop(child)
        returncode = child.returncode
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop(child)  # leftovers of a finished torchrun, if any
    return finalize(cfg, job_dir, returncode, interrupted)


def _raise_interrupted(signum, frame):
    raise Interrupted()


def finalize(cfg: DictConfig, job_dir: Path, returncode: int | None, interrupted: bool) -> dict:
    """Keep rank 0's results when the job succeeded; otherwise write a failed/interrupted record
    that keeps every step already measured."""
    from omegaconf import OmegaConf

    results = read_results(job_dir)
    if returncode == 0 and results is not None and not interrupted:
        return results
    if interrupted:
        status, error = "interrupted", "stopped by a signal (Ctrl-C or SIGTERM) before the job ended"
    else:
        status = "failed"
        error = _first_rank_error(job_dir) or f"torchrun exited with code {returncode} and no rank recorded an error"
    steps = results["steps"] if results else read_steps(job_dir)
    summary = results["summary"] if results else _partial_summary(cfg, steps)
    env = results["env"] if results else {"world_size": cfg.world_size}
    results = make_results(status, error, OmegaConf.to_container(cfg, resolve=True), env, summary, steps)
    write_json_atomic(job_dir / RESULTS, results)
    return results


def _partial_summary(cfg: DictConfig, steps: list[dict]) -> dict:
    if cfg.task.name != "train" or not steps:
        return {}
    from ddp_lab.tasks.train import summarize_steps

    return summarize_steps(steps, cfg.train.warmup_steps)
