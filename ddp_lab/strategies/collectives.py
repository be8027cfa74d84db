"""The collectives strategies share: mean all-reduce (blocking, flat, async and stamped), the start-up
broadcast, and torch's single-tensor reduce-scatter / all-gather under their current names.

Gloo has no AVG op, so every mean divides by the world size and sums (as torch DDP's default hook
does: divide first, so the sum cannot overflow in a narrow dtype). Async launches return a
`Stamp` (strategies/comm_stats.py) whose end a callback on the collective's future sets, because a
host timer around an async launch measures only the launch.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddp_lab.strategies.comm_stats import CommStats, Stamp
from ddp_lab.units import tensor_bytes

# torch 2.13 renamed the single-tensor collectives (the old names print a FutureWarning on every
# call); older releases only have the old names.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce_mean_(tensor: torch.Tensor, group=None) -> None:
    """Sum then divide in place: gloo has no ReduceOp.AVG, and one code path serves both backends."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    tensor.div_(dist.get_world_size(group))


def flat_all_reduce_mean_(grads: list[torch.Tensor], comm: CommStats) -> None:
    """Average `grads` in place with one all-reduce of a flattened copy: one call's latency for all."""
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    with comm.timed(tensor_bytes(flat)):
        all_reduce_mean_(flat)
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


def all_reduce_mean_async(tensor: torch.Tensor) -> tuple[torch.futures.Future, Stamp]:
    """Divide by the world size, launch a SUM all-reduce; return (future of the tensor, its stamp)."""
    tensor.div_(dist.get_world_size())
    return launch_stamped(lambda: [dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)],
                          tensor_bytes(tensor), tensor.is_cuda)


def launch_stamped(launch, nbytes: int, on_cuda: bool) -> tuple[torch.futures.Future, Stamp]:
    """Run `launch()` (it starts async collectives and returns their works) under one `Stamp`.

    The returned future completes when every work has; waiting on it raises if one failed. On
    CUDA pass a single work: its future's callback runs on the collective's stream, where the
    end event must be recorded (a combined future of several would lose that stream).
    """
    stamp = Stamp(nbytes)
    if on_cuda:
        stamp.start_event = torch.cuda.Event(enable_timing=True)
        stamp.start_event.record()
    stamp.start = time.perf_counter()
    works = launch()
    stamp.calls = len(works)
    try:
        futures = [work.get_future() for work in works]
    except RuntimeError:  # gloo's reduce_scatter (built from all-reduce) has no future
        return _WaitedWorks(works, stamp), stamp
    if on_cuda and len(futures) != 1:
        raise ValueError("launch_stamped on CUDA times exactly one collective")
    combined = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)

    def done(fut: torch.futures.Future):
        if on_cuda:
            stamp.end_event = torch.cuda.Event(enable_timing=True)
            stamp.end_event.record()
        else:
            stamp.end = time.perf_counter()
        value = fut.value()  # raises here, and so in wait(), if the collective failed
        if len(futures) > 1:
            return [f.value() for f in value]
        return value[0]

    return combined.then(done), stamp


class _WaitedWorks:
    """Stands in for a future where a work offers none: done when every work is, and the stamp ends
    at the `wait()` that sees them done (an upper bound of the collective's end)."""

    def __init__(self, works, stamp: Stamp):
        self.works, self.stamp = works, stamp

    def done(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        if self.stamp.end is None:
            self.stamp.end = time.perf_counter()


def broadcast_module_state(module: torch.nn.Module, src: int = 0) -> None:
    """Copy every parameter and buffer (frozen ones too) from `src`, so all ranks start identical.

    Tied parameters appear once in `parameters()`, so each storage is sent once.
    """
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=src)
