"""Why a job failed, as one line that names the rank and the cause.

A failed job leaves three kinds of evidence, and none is enough alone:

- `errors/rank{R}.txt`: the one line each rank wrote as it raised (rank/worker.py). The earliest is the
  root cause; ranks that fail later usually fail *because* of it (a peer's socket closed mid
  all-reduce, or a collective timed out waiting for a rank that hung), and a rank that torchrun
  stopped while it was still running says so (`Terminated`).
- torchrun's failure summary (its stderr, kept in `logs/torchrun-node{N}.log`): the exit code of
  every rank, and the signal of a rank that died without raising. A rank killed by SIGKILL wrote
  nothing: that is how the kernel's OOM killer ends a process, so it is named as such.
- the kernel's OOM-kill counter (`oom_kill` in /proc/vmstat, or the cgroup's memory.events), read
  before and after the job: if it rose, a SIGKILLed rank was killed for memory, not by a person.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from ddp_lab.jobdir import ERRORS, OOM, TERMINATED, rank_log

_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_PEER_GONE = re.compile(r"connection (reset|closed)|broken pipe|closed by peer", re.IGNORECASE)
# torchrun's summary: "rank      : 1 (local_rank: 1)" then "exitcode  : -9 (pid: 123)"
_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def rank_errors(job_dir: Path) -> list[tuple[int, str]]:
    """(rank, line) for every rank that recorded an error, earliest first."""
    folder = Path(job_dir) / ERRORS
    files = sorted(folder.glob("rank*.txt"), key=lambda p: p.stat().st_mtime_ns) if folder.is_dir() else []
    return [(int(p.stem[4:]), p.read_text().strip()) for p in files]


def signalled_ranks(torchrun_log: str) -> dict[int, int]:
    """{rank: signal number} for ranks that torchrun saw die from a signal (exit code -N)."""
    return {int(rank): -int(code) for rank, code in _FAILURE.findall(torchrun_log) if int(code) < 0}


def oom_kills() -> int:
    """The kernel's count of OOM kills (this cgroup's, or the machine's): compare before and after."""
    for path, key in (("/sys/fs/cgroup/memory.events", "oom_kill"), ("/proc/vmstat", "oom_kill")):
        try:
            for line in Path(path).read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
        except (OSError, ValueError):
            continue
    return 0


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def diagnose(job_dir: Path, returncode: int | None, torchrun_log: str, oom_killed: bool,
             timeout_s: float) -> str:
    """The one-line error of a failed job: the rank that failed first, and why."""
    errors = rank_errors(job_dir)
    wrote = {rank for rank, _ in errors}
    silent = {rank: number for rank, number in signalled_ranks(torchrun_log).items() if rank not in wrote}
    if oom_killed and signal.SIGKILL in silent.values():
        rank = min(r for r, n in silent.items() if n == signal.SIGKILL)
        return f"rank {rank}: {OOM}: killed by the kernel's OOM killer (SIGKILL)"
    causes = [(rank, line) for rank, line in errors if not line.startswith(TERMINATED)]
    if causes and not (silent and _PEER_GONE.search(causes[0][1])):  # a lost peer is a symptom
        rank, line = causes[0]
        if _TIMEOUT.search(line):
            # Ranks still running when torchrun stopped the job never reached the collective.
            stuck = sorted((wrote - {r for r, _ in causes}) | set(silent))
            who = f"rank {', '.join(map(str, stuck))} never joined it (hung)" if stuck else "a rank stopped responding"
            return f"rank {rank}: collective timed out after backend.timeout_s={timeout_s:g} s, {who}: {line}"
        return f"rank {rank}: {line}"
    # Died without a word, and nobody else raised first. SIGTERM last: torchrun sends it to stop the rest.
    for rank, number in sorted(silent.items(), key=lambda item: (item[1] == signal.SIGTERM, item[0])):
        if number == signal.SIGKILL:
            return (f"rank {rank}: killed by SIGKILL before it could say why (the kernel's OOM killer sends "
                    "SIGKILL, but no OOM kill was recorded, so something else killed it)")
        return f"rank {rank}: died from {_signal_name(number)} without a Python error (see {rank_log(rank)})"
    return f"torchrun exited with code {returncode} and no rank recorded an error (see logs/)"
