"""Fault injection (`fault.kind`, `fault.rank` or `fault.node`, `fault.step`): make a rank (or every rank of a
node) fail on purpose, or slow.

For testing what a failure does to a job and a sweep: a crash must end the job with a status that
names the rank, a hang must be ended by the collective timeout (or, with `fault.rank=-1`, every
rank hung outside any collective, by the launcher's watchdog), never hang the job, and running out
of memory must say so.

`fault.kind=slow` (`fault.slowdown`, from `fault.step` on, for the rest of the run): a straggler. The
rank's forward and backward take `slowdown` times as long: `SlowCompute` times each stretch of compute
between two of its hooks (a leaf module's forward ending; in backward, a leaf's output gradient arriving
and a parameter's gradient accumulated) and sleeps (slowdown - 1) times it there. Its hooks are installed
before the strategy wraps the model, so they run before the strategy's own: a gradient's collective is
issued after the stretched backward that produced it, as a slower processor would issue it, and the
collectives themselves run at their own speed (a sleep, not busy work: on a shared CPU it takes no core
from the other ranks). The optimizer step and the data are not slowed.
"""

from __future__ import annotations

import os
import resource
import time

import torch
from torch import nn

from ddp_lab.machine import host_available_bytes
from ddp_lab.rank.process_group import restart_count
from ddp_lab.spec.figures import INJECTED_DELAY


class InjectedFault(RuntimeError):
    pass


def aimed_at(fault, rank: int) -> bool:
    """Whether `fault` is this rank's: every rank of fault.node (torchrun's GROUP_RANK) where it is given, else
    fault.rank (-1: every rank)."""
    if getattr(fault, "node", None) is not None:
        return int(os.environ.get("GROUP_RANK", 0)) == fault.node
    return fault.rank in (rank, -1)


def maybe_inject_fault(fault, rank: int, step: int, slow: SlowCompute | None = None) -> None:
    """Inject `fault` if this is its rank and step, on the job's first attempt only: after torchrun restarted
    the workers (`launcher.max_restarts`) the run recovers from its checkpoint and passes that step. A slow
    rank (`slow`, from `slow_compute`) is slow from `fault.step` on, restarts included."""
    if slow is not None:
        slow.active, slow.slept_s = step >= fault.step, 0.0  # what a held-out loss slept is no step's
    kind = str(getattr(fault.kind, "value", fault.kind))
    if kind in ("none", "slow") or not aimed_at(fault, rank) or step != fault.step:
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


class SlowCompute:
    """`fault.kind=slow` on this rank (module docstring): hooks on `module`'s leaves and parameters that
    stretch each piece of compute by `slowdown` once `active`. `clock` and `sleep` are time's, replaceable."""

    def __init__(self, module: nn.Module, slowdown: float, clock=time.perf_counter, sleep=time.sleep):
        self.slowdown, self.clock, self.sleep = slowdown, clock, sleep
        self.active, self.mark, self.slept_s = False, None, 0.0  # slept_s: since the last `pop()`
        module.register_forward_pre_hook(lambda *_: self._start())
        for leaf in module.modules():
            if next(leaf.children(), None) is None:
                leaf.register_forward_hook(self._after_forward)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _: self.stretch())

    def _start(self) -> None:
        self.mark = self.clock()

    def _after_forward(self, module, args, output) -> None:
        self.stretch()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self.stretch())

    def pop(self) -> dict:
        """The step's figure once active: the time added since the last pop (0 on a rank of slowdown 1)."""
        figures = {INJECTED_DELAY.key: self.slept_s * 1e3} if self.active else {}
        self.slept_s = 0.0
        return figures

    def stretch(self) -> None:
        """Sleep (slowdown - 1) x the time since the last hook, then mark now."""
        now = self.clock()
        if self.active and self.mark is not None and self.slowdown > 1:
            pause = (self.slowdown - 1) * (now - self.mark)
            self.sleep(pause)
            self.slept_s += pause
        self.mark = self.clock()


def slow_compute(fault, rank: int, module: nn.Module) -> SlowCompute | None:
    """With fault.kind=slow, on every rank, a SlowCompute on `module` (before the strategy wraps it): of
    `fault.slowdown` on the slow rank, of 1 (nothing added) on the others, so that every rank has the step's
    figure to reduce. None without it."""
    if str(getattr(fault.kind, "value", fault.kind)) != "slow":
        return None
    return SlowCompute(module, float(fault.slowdown) if aimed_at(fault, rank) else 1.0)


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
