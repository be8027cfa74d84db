"""How a step's communication is measured: `CommStats`, and the stamps of async collectives.

Two figures per step, as the design notes define them:

- total (`comm_ms`): how long collectives were in flight: the union of their [start, end]
  intervals, so overlapping async collectives are not double counted and a blocking one counts
  its whole duration.
- exposed (`exposed_comm_ms`): the time a rank waits for a collective while it computes nothing:
  `finish_gradient_synchronization()`, from the end of backward to gradients ready, and any wait
  for a collective elsewhere (`waited()`: PowerSGD waits for a bucket's P inside backward). For
  synchronous strategies exposed == total. Arithmetic a strategy does on the gradients to send
  fewer bytes (PowerSGD's matrix products and QR) is compute, not comm, wherever it runs: timed
  apart by `arithmetic()` as `compress_ms` and taken out of the exposed figure, so a compressing
  strategy's overlap % means what bucketed's does.
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

`measure.per_collective=false` (`set_per_collective(False)`, once per rank) turns the per-collective part off,
so its own cost can be measured against a run with it on (benchmarks/gpu.sh runs both): no stamp gets a clock,
an event or a completion callback, a blocking collective is not bracketed by device synchronizations, and
compression arithmetic is not timed on CUDA. What stays is per step or free: the collectives' count and
bytes, the exposed wait (`exposed()`, one bracket around the sync), host-timed waits. `comm_ms` and the
overlap % are then absent, never 0: nothing measured them.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from ddp_lab.arithmetic.intervals import total
from ddp_lab.rank.process_group import synchronize

_per_collective = True


def set_per_collective(on: bool) -> None:
    """`measure.per_collective`: stamp each collective (on, the default) or only count it (off)."""
    global _per_collective
    _per_collective = bool(on)


def per_collective() -> bool:
    """Whether collectives get stamps (clocks, CUDA events, completion callbacks) in this process."""
    return _per_collective


class CommStats:
    """One rank's communication figures for the current step; `pop()` hands them over and resets."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sees_collectives = True  # False where the collectives run unseen (torch's DDP with no comm hook)
        self._carried: list[tuple[Stamp, bool]] = []  # collectives that may outlive their step, launched in this one?
        self._last_pop = 0.0  # when the previous step's figures were taken, while a carried collective is in flight
        self.reset()

    def reset(self) -> None:
        self.intervals: list[tuple[float, float]] = []
        self.sizes: list[int] = []  # bytes of each interval's collectives, in the same order
        self.collectives = 0
        self.untimed = 0  # collectives counted without a stamp (measure.per_collective=false)
        self.bytes = 0
        self.exposed_s = 0.0
        self.exposed_optimizer_s = 0.0
        self.compress_s = 0.0
        self._arithmetic_events: list = []  # CUDA: (start, end) events of arithmetic not yet added up
        self._exposing = False  # inside exposed(): a wait there is already counted

    def add(self, start: float | None, end: float | None, nbytes: int, calls: int = 1) -> None:
        """Record collectives (`calls` launched together) in flight from `start` to `end` (perf_counter s);
        None for both: counted, not timed (`measure.per_collective=false`)."""
        if start is not None:
            self.intervals.append((start, end))
            self.sizes.append(nbytes)
        else:
            self.untimed += calls
        self.collectives += calls
        self.bytes += nbytes

    @contextmanager
    def timed(self, nbytes: int, calls: int = 1):
        """Time blocking collectives (`calls` of them launched together, one interval); on CUDA the
        device is synchronized on both sides. With per-collective figures off: counted only."""
        if not _per_collective:
            yield
            self.add(None, None, nbytes, calls)
            return
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
        self._settle()
        start, arithmetic = time.perf_counter(), self.compress_s
        self._exposing = True
        try:
            yield
        finally:
            self._exposing = False
        synchronize(self.device)
        self._settle()
        elapsed = time.perf_counter() - start - (self.compress_s - arithmetic)  # compression is compute
        self.exposed_s += elapsed
        if in_optimizer:
            self.exposed_optimizer_s += elapsed

    @contextmanager
    def waited(self):
        """A wait for a collective outside `finish_gradient_synchronization()` (inside backward): exposed.
        Host time: on CUDA such a wait holds the stream, not the host, and shows as compute there."""
        start = time.perf_counter()
        yield
        elapsed = time.perf_counter() - start
        if self.device.type != "cuda" and not self._exposing:
            self.exposed_s += elapsed

    @contextmanager
    def arithmetic(self):
        """Compression arithmetic (`compress_ms`): compute, kept out of the exposed figure. On CUDA
        timed by events on the current stream (no synchronization inside backward), added up at the
        next synchronization."""
        if self.device.type != "cuda":
            start = time.perf_counter()
            yield
            self.compress_s += time.perf_counter() - start
            return
        if not _per_collective:
            yield
            return
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
        yield
        events[1].record()
        self._arithmetic_events.append(events)

    def _settle(self) -> None:
        """Add up the arithmetic CUDA events (call after a device synchronize)."""
        for start, end in self._arithmetic_events:
            self.compress_s += start.elapsed_time(end) / 1e3
        self._arithmetic_events = []

    def carry(self, stamp: "Stamp") -> None:
        """An async collective that may still be in flight when this step's figures are taken (local SGD's
        delayed sync): at each `pop` until it ends, the part of its flight inside that step joins `comm_ms`;
        its bytes and its call count join the step that launched it."""
        if stamp.start is None:  # per-collective figures off: counted in this step, never timed
            self.add(None, None, stamp.nbytes, stamp.calls)
            return
        self._carried.append((stamp, True))

    def _carry_over(self) -> None:
        now, still = time.perf_counter(), []
        for stamp, launched_here in self._carried:
            end = stamp.end
            if end is None and stamp.end_event is not None:
                end = host_time_of(stamp.end_event)
            start = stamp.start if launched_here else max(stamp.start, self._last_pop)
            self.add(start, max(end if end is not None else now, start),
                     stamp.nbytes if launched_here else 0, stamp.calls if launched_here else 0)
            if end is None:
                still.append((stamp, False))
        self._carried, self._last_pop = still, now

    def pop(self) -> dict:
        """This step's figures (milliseconds, counts, bytes), then start afresh for the next step."""
        if self._carried:
            self._carry_over()
        if self._arithmetic_events:
            synchronize(self.device)
            self._settle()
        out = {
            "comm_ms": total(self.intervals) * 1e3,
            "exposed_comm_ms": self.exposed_s * 1e3,
            "exposed_optimizer_comm_ms": self.exposed_optimizer_s * 1e3,
            "compress_ms": self.compress_s * 1e3,
            "collectives": self.collectives,
            "comm_bytes": self.bytes,
        }
        if not self.sees_collectives:  # issued where nothing of the lab's sees them (torch's DDP, bare)
            del out["comm_ms"], out["collectives"], out["comm_bytes"]
        elif self.untimed and self.untimed == self.collectives:  # counted, never timed: no comm_ms, not 0
            del out["comm_ms"]
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
    timed = [s for s in stamps if s.end_event is not None and s.start_event is not None]
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


def end_when_done(stamp: Stamp, work, on_cuda: bool) -> None:
    """Set the stamp's end when `work` completes: its future's callback (on NCCL it runs on the
    collective's stream, where a CUDA event records the real end; the host clock there would read
    the launch). A work with no future ends when the step's figures are taken."""
    if stamp.start is None:
        return  # per-collective figures off: counted, not timed

    def done(fut):
        if on_cuda:
            stamp.end_event = torch.cuda.Event(enable_timing=True)
            stamp.end_event.record()
        else:
            stamp.end = time.perf_counter()
    try:
        work.get_future().then(done)
    except (AttributeError, RuntimeError):  # no future (a wrapper's own work object): ends at close_stamps
        pass


def begin_stamp(nbytes: int, on_cuda: bool) -> Stamp:
    """A collective's stamp at its launch: the host clock, and on CUDA an event on the issuing stream (none of
    them with per-collective figures off: the stamp only counts)."""
    stamp = Stamp(nbytes)
    if not _per_collective:
        return stamp
    if on_cuda:  # on the stream the collective is issued from: no host synchronization
        stamp.start_event = torch.cuda.Event(enable_timing=True)
        stamp.start_event.record()
    stamp.start = time.perf_counter()
    return stamp


def end_blocking(stamp: Stamp, on_cuda: bool) -> None:
    """A blocking collective's end, right after its call returned."""
    if stamp.start is None:
        return
    if on_cuda:  # a blocking collective: the issuing stream waits for it, an event after it marks its end
        stamp.end_event = torch.cuda.Event(enable_timing=True)
        stamp.end_event.record()
    else:
        stamp.end = time.perf_counter()


def close_stamps(stamps: list[Stamp], comm: CommStats) -> None:
    """Add a step's stamps to `comm` and forget them; one whose end never came (a work with no future)
    ends now."""
    now = time.perf_counter()
    for stamp in stamps:
        if stamp.start is not None:
            stamp.end = stamp.end if stamp.end is not None else now
    record_intervals(stamps, comm)
    stamps.clear()
