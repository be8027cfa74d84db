"""How a step's communication is measured: `CommStats`, and the stamps of async collectives.

Two figures per step, as the design notes define them:

- total (`comm_ms`): how long collectives were in flight: the union of their [start, end]
  intervals, so overlapping async collectives are not double counted and a blocking one counts
  its whole duration.
- exposed (`exposed_comm_ms`): the time spent in `finish_gradient_synchronization()`, that is
  from the end of backward to gradients ready. For synchronous strategies exposed == total.
  Sharded optimizers also wait for communication inside their step (zero1's parameter
  broadcasts); that wait is exposed too, and its part is kept apart as
  `exposed_optimizer_comm_ms` so a report can take it out of the optimizer phase, not compute.

A host timer around `dist.all_reduce(..., async_op=True)` measures only the launch. So an async
collective carries a `Stamp` whose end is set by a callback chained on its future
(strategies/collectives.py launches them):

- CPU (gloo): gloo completes the future on its worker thread right after the reduction finishes,
  and the chained callback reads `time.perf_counter()` there. The callback needs the GIL, so the
  end can be late by the time the main thread takes to release it: the autograd engine and
  `wait()` release it, Python hooks hold it for microseconds. An upper bound, close to the truth.
- CUDA (nccl): the future completes when the kernel is *enqueued*, so a host clock would read the
  launch again. The callback instead records a CUDA event on the stream torch hands it, which
  runs after the collective's kernel; the start is an event recorded on the compute stream just
  before the launch (when the gradient is really computed). `record_intervals` converts both to
  the host clock after a synchronize, so intervals from every strategy share one time axis.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from ddp_lab.analysis.intervals import total
from ddp_lab.rank.process_group import synchronize


class CommStats:
    """One rank's communication figures for the current step; `pop()` hands them over and resets."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.intervals: list[tuple[float, float]] = []
        self.collectives = 0
        self.bytes = 0
        self.exposed_s = 0.0
        self.exposed_optimizer_s = 0.0

    def add(self, start: float, end: float, nbytes: int, calls: int = 1) -> None:
        """Record collectives (`calls` launched together) in flight from `start` to `end` (perf_counter s)."""
        self.intervals.append((start, end))
        self.collectives += calls
        self.bytes += nbytes

    @contextmanager
    def timed(self, nbytes: int, calls: int = 1):
        """Time blocking collectives (`calls` of them launched together, one interval); on CUDA the
        device is synchronized on both sides."""
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        self.add(start, time.perf_counter(), nbytes, calls)

    @contextmanager
    def exposed(self, in_optimizer: bool = False):
        """Wrap `finish_gradient_synchronization()` (the communication backward did not hide), or
        with `in_optimizer=True` a wait for communication inside the optimizer step."""
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.exposed_s += elapsed
        if in_optimizer:
            self.exposed_optimizer_s += elapsed

    def pop(self) -> dict:
        """This step's figures (milliseconds, counts, bytes), then start afresh for the next step."""
        out = {
            "comm_ms": total(self.intervals) * 1e3,
            "exposed_comm_ms": self.exposed_s * 1e3,
            "exposed_optimizer_comm_ms": self.exposed_optimizer_s * 1e3,
            "collectives": self.collectives,
            "comm_bytes": self.bytes,
        }
        self.reset()
        return out


class Stamp:
    """One collective's in-flight interval (or `calls` launched together): host seconds on CPU, CUDA
    events on GPU until converted."""

    __slots__ = ("nbytes", "calls", "start", "end", "start_event", "end_event")

    def __init__(self, nbytes: int, calls: int = 1):
        self.nbytes, self.calls = nbytes, calls
        self.start = self.end = None
        self.start_event = self.end_event = None


def record_intervals(stamps: list[Stamp], comm: CommStats) -> None:
    """Add finished collectives to `comm`. Call after their futures are waited for."""
    timed = [s for s in stamps if s.end_event is not None]
    if timed:
        now, reference = _reference_point()
        for s in timed:
            s.start = now - s.start_event.elapsed_time(reference) / 1e3
            s.end = now - s.end_event.elapsed_time(reference) / 1e3
    for s in stamps:
        comm.add(s.start, s.end, s.nbytes, s.calls)


def host_time_of(event: torch.cuda.Event) -> float:
    """The host-clock time at which a recorded CUDA event ran (synchronizes)."""
    now, reference = _reference_point()
    return now - event.elapsed_time(reference) / 1e3


def _reference_point() -> tuple[float, torch.cuda.Event]:
    """A CUDA event that has just run and the host time it ran at: CUDA times onto the host clock."""
    reference = torch.cuda.Event(enable_timing=True)
    reference.record()
    reference.synchronize()
    return time.perf_counter(), reference
