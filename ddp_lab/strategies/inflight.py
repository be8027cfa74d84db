"""Launching an async all-reduce and measuring how long it was really in flight.

A host timer around `dist.all_reduce(..., async_op=True)` measures only the launch. So the end of
each collective is stamped by a callback chained on the collective's future:

- CPU (gloo): gloo completes the future on its worker thread right after the reduction finishes,
  and the chained callback reads `time.perf_counter()` there. The callback needs the GIL, so the
  end can be late by the time the main thread takes to release it: the autograd engine and
  `wait()` release it, Python hooks hold it for microseconds. An upper bound, close to the truth.
- CUDA (nccl): the future completes when the kernel is *enqueued*, so a host clock would read the
  launch again. The callback instead records a CUDA event on the stream torch hands it, which
  runs after the collective's kernel; the start is an event recorded on the compute stream just
  before the launch (when the gradient is really computed). `record_intervals` converts both to
  the host clock after a synchronize, so intervals from every strategy share one time axis.

Gloo has no AVG op, so every launch divides by the world size first (as torch DDP's default hook
does) and sums.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ddp_lab.comm_stats import CommStats


class Stamp:
    """One collective's in-flight interval: host seconds on CPU, CUDA events on GPU until converted."""

    __slots__ = ("nbytes", "start", "end", "start_event", "end_event")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.start = self.end = None
        self.start_event = self.end_event = None


def all_reduce_mean_async(tensor: torch.Tensor) -> tuple[torch.futures.Future, Stamp]:
    """Divide by the world size, launch a SUM all-reduce; return (future of the tensor, its stamp)."""
    tensor.div_(dist.get_world_size())
    stamp = Stamp(tensor.numel() * tensor.element_size())
    on_cuda = tensor.is_cuda
    if on_cuda:
        stamp.start_event = torch.cuda.Event(enable_timing=True)
        stamp.start_event.record()
    stamp.start = time.perf_counter()
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)

    def done(fut: torch.futures.Future) -> torch.Tensor:
        if on_cuda:
            stamp.end_event = torch.cuda.Event(enable_timing=True)
            stamp.end_event.record()
        else:
            stamp.end = time.perf_counter()
        return fut.value()[0]  # raises here, and so in wait(), if the collective failed

    return work.get_future().then(done), stamp


def record_intervals(stamps: list[Stamp], comm: CommStats) -> None:
    """Add finished collectives to `comm`. Call after their futures are waited for."""
    timed = [s for s in stamps if s.end_event is not None]
    if timed:
        # Put CUDA event times on the host clock: a reference event, then its host time.
        reference = torch.cuda.Event(enable_timing=True)
        reference.record()
        reference.synchronize()
        now = time.perf_counter()
        for s in timed:
            s.start = now - s.start_event.elapsed_time(reference) / 1e3
            s.end = now - s.end_event.elapsed_time(reference) / 1e3
    for s in stamps:
        comm.add(s.start, s.end, s.nbytes)


def host_time_of(event: torch.cuda.Event) -> float:
    """The host-clock time at which a recorded CUDA event ran (synchronizes)."""
    reference = torch.cuda.Event(enable_timing=True)
    reference.record()
    reference.synchronize()
    return time.perf_counter() - event.elapsed_time(reference) / 1e3
