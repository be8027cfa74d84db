"""Per-step communication accounting shared by every gradient-sync wrapper.

Two figures per step, as the design notes define them:

- total (`comm_ms`): how long collectives were in flight: the union of their [start, end]
  intervals, so overlapping async collectives are not double counted and a blocking one counts
  its whole duration.
- exposed (`exposed_comm_ms`): the time spent in `finish_gradient_synchronization()`, that is
  from the end of backward to gradients ready. For synchronous strategies exposed == total.
  Sharded optimizers also wait for communication inside their step (zero1's parameter
  broadcasts); that wait is exposed too, and its part is kept apart as
  `exposed_optimizer_comm_ms` so a report can take it out of the optimizer phase, not compute.

A host timer around an async launch measures only the launch, so async wrappers record a
collective's end when its future completes, and on CUDA the interval is closed only after a
device synchronize (see `timed`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from ddp_lab.distributed import synchronize


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals (seconds in, seconds out)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


class CommStats:
    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.intervals: list[tuple[float, float]] = []
        self.collectives = 0
        self.bytes = 0
        self.exposed_s = 0.0
        self.exposed_optimizer_s = 0.0

    def add(self, start: float, end: float, nbytes: int) -> None:
        """Record one collective that was in flight from `start` to `end` (perf_counter seconds)."""
        self.intervals.append((start, end))
        self.collectives += 1
        self.bytes += nbytes

    @contextmanager
    def timed(self, nbytes: int):
        """Time a blocking collective; on CUDA the device is synchronized on both sides."""
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        self.add(start, time.perf_counter(), nbytes)

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
            "comm_ms": union_length(self.intervals) * 1e3,
            "exposed_comm_ms": self.exposed_s * 1e3,
            "exposed_optimizer_comm_ms": self.exposed_optimizer_s * 1e3,
            "collectives": self.collectives,
            "comm_bytes": self.bytes,
        }
        self.reset()
        return out
