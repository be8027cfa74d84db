"""Fault injection (`fault.kind`, `fault.rank`, `fault.step`): make a rank fail on purpose.

For testing what a failure does to a job and a sweep: a crash must end the job with a status that
names the rank, a hang must be ended by the collective timeout (or, with `fault.rank=-1`, every
rank hung outside any collective, by the launcher's watchdog), never hang the job, and running out
of memory must say so.
"""

from __future__ import annotations

import resource
import time

import torch

from ddp_lab.machine import host_available_bytes
from ddp_lab.rank.process_group import restart_count


class InjectedFault(RuntimeError):
    pass


def maybe_inject_fault(fault, rank: int, step: int) -> None:
    """Inject `fault` if this is its rank and step, on the job's first attempt only: after torchrun restarted
    the workers (`launcher.max_restarts`) the run recovers from its checkpoint and passes that step."""
    kind = str(getattr(fault.kind, "value", fault.kind))
    if kind == "none" or fault.rank not in (rank, -1) or step != fault.step:
        return
    if restart_count() > 0:
        return
    if kind == "crash":
        raise InjectedFault(f"injected crash at step {step}")
    if kind == "hang":
        while True:  # never reaches the next collective: the others time out
            time.sleep(1)
    if kind == "oom":
        run_out_of_memory()


def run_out_of_memory() -> None:
    """Ask for twice the memory this machine has left, as an oversized batch would.

    The allocator refuses at once and torch raises its out-of-memory error. The address-space
    limit makes sure of it even where the kernel overcommits, so a test never pushes a shared
    machine into swap or its OOM killer (which would pick a process, maybe not this one).
    """
    request = 2 * host_available_bytes()
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + request // 4, resource.getrlimit(resource.RLIMIT_AS)[1]))
    torch.empty(request // 4, dtype=torch.float32)  # `request` bytes
