"""Fault injection (`fault.kind`, `fault.rank`, `fault.step`): make a rank fail on purpose.

For testing what a failure does to a job and a sweep: a crash must end the job with a status that
names the rank, a hang must be ended by the collective timeout, never hang the job.
"""

from __future__ import annotations

import time


class InjectedFault(RuntimeError):
    pass


def maybe_inject_fault(fault, rank: int, step: int) -> None:
    kind = str(getattr(fault.kind, "value", fault.kind))
    if kind == "none" or rank != fault.rank or step != fault.step:
        return
    if kind == "crash":
        raise InjectedFault(f"injected crash at step {step}")
    if kind == "hang":
        while True:  # never reaches the next collective: the others time out
            time.sleep(1)
    if kind == "oom":
        chunks = []
        while True:  # grow until the allocator or the kernel refuses
            chunks.append(bytearray(1 << 30))
