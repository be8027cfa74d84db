"""Find a job's processes from outside, as a user would with pgrep: by the job folder on their command line."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def leftovers(path: Path) -> list[str]:
    """Command lines of live processes that mention `path` (launch.py, torchrun, ranks of its jobs)."""
    out = subprocess.run(["pgrep", "-af", str(path)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def rank_pid(job_dir: Path, rank: int) -> int | None:
    """The pid of rank `rank` of the job in `job_dir` (its worker has RANK in its environment)."""
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"ddp_lab.rank.worker" in args and str(job_dir).encode() in args and f"RANK={rank}".encode() in env:
            return int(entry.name)
    return None


def wait_for(condition, timeout: float, what: str):
    """Poll until `condition()` is truthy (speed-independent tests wait for a state, not a time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"waited {timeout} s for {what}")
