"""The collectives strategies share: mean all-reduce (blocking, flat, async and stamped), the start-up
broadcast, and reduce-scatter / all-gather / broadcasts by the implementation `backend.collectives` chooses.

Reduce-scatter, all-gather and a step's broadcasts (`reduce_scatter`, `all_gather`, `broadcasts`): every
strategy that shards calls these, never torch's directly, so one setting decides what runs under all of
them. `ring`: the lab's bandwidth-optimal rings over point-to-point (strategies/rings.py), the default on
gloo, whose own reduce-scatter is an all-reduce underneath and whose broadcast sends every copy from the
source; `native`: the backend's own `reduce_scatter_single` / `all_gather_single` / `broadcast` (nccl's
rings and trees; gloo's shortcuts, kept so a user can see the difference). `auto` (the default) is the
ring on gloo and the backend's own elsewhere.

Gloo has no AVG op, so every mean divides by the world size and sums (as torch DDP's default hook
does: divide first, so the sum cannot overflow in a narrow dtype). Async launches return a
`Stamp` (strategies/comm_stats.py) whose end a callback on the collective's future sets, because a
host timer around an async launch measures only the launch.

`strategy.comm_dtype` (the one home of the cast-reduce-uncast, for every strategy that reduces
gradients): `to_wire` makes the tensor that is sent, the fp32 gradient divided by the world size
and rounded once to bf16 or fp16 (dividing *before* the sum, as torch's fp16_compress_hook does,
so N gradients near fp16's maximum of 65504 cannot overflow their sum); the collective sums it in
that dtype, and `from_wire` copies the result back into the fp32 gradient. Half the bytes on the
wire, and `comm_bytes` counts the wire tensor's. With comm_dtype fp32 (the default) nothing is
cast and the collectives run in place exactly as before.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddp_lab.strategies.comm_stats import CommStats, Stamp, per_collective
from ddp_lab.strategies.exit_drain import track
from ddp_lab.strategies.rings import (
    global_rank,
    ring_all_gather,
    ring_broadcasts,
    ring_reduce_scatter,
    ring_two_level_all_reduce,
)
from ddp_lab.units import tensor_bytes

# torch 2.13 renamed the single-tensor collectives (the old names print a FutureWarning on every
# call); older releases only have the old names.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


COLLECTIVES = ("auto", "ring", "native")
_chosen = "auto"


def choose_collectives(name: str) -> None:
    """Set `backend.collectives` for this process (the worker does it once, tests per scenario)."""
    global _chosen
    if name not in COLLECTIVES:
        raise ValueError(f"backend.collectives must be one of {', '.join(COLLECTIVES)}, got {name!r}")
    _chosen = name


def collectives_in_use(group=None) -> str:
    """`ring` or `native`: what `reduce_scatter` and `all_gather` run on `group` (auto: rings on gloo only).
    A strategy reads it once when built (its `collectives`), so a test can pin one path per instance."""
    if _chosen != "auto":
        return _chosen
    return "ring" if dist.get_backend(group) == "gloo" else "native"


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
                   sizes: list[int] | None = None, implementation: str | None = None):
    """SUM of `input` (1-D, one row per rank: equal rows, or `sizes` with the ring) over the group's
    ranks, row r into `output` on rank r, by `implementation` (ring, native; None: `collectives_in_use`).
    Returns a work when `async_op`."""
    if (implementation or collectives_in_use(group)) == "ring":
        return ring_reduce_scatter(output, input, group=group, async_op=async_op, sizes=sizes)
    _equal_rows(sizes)
    return reduce_scatter_single(output, input, group=group, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
               sizes: list[int] | None = None, implementation: str | None = None):
    """Every rank's `input` into `output` (1-D) in rank order (rows of `sizes` with the ring), by
    `implementation` (as `reduce_scatter`). Returns a work when `async_op`."""
    if (implementation or collectives_in_use(group)) == "ring":  # in place when `input` is this rank's row of `output`
        return ring_all_gather(output, input, group=group, async_op=async_op, sizes=sizes)
    _equal_rows(sizes)
    if dist.get_backend(group) != "nccl" and input.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
        input = input.clone()  # nccl gathers in place from the output's own row; gloo may not
    return all_gather_single(output, input, group=group, async_op=async_op)


def broadcasts(tensors: list[torch.Tensor], sources: list[int], group=None,
               implementation: str | None = None) -> list:
    """Launch a broadcast of each tensor (contiguous) from its group rank in `sources`, in place, all in
    flight at once, by `implementation` (as `reduce_scatter`); returns the works to wait for (the ring:
    one for them all)."""
    if (implementation or collectives_in_use(group)) == "ring":
        return [ring_broadcasts(tensors, sources, group=group, async_op=True)]
    return [dist.broadcast(t, src=global_rank(group, s), group=group, async_op=True) for t, s in zip(tensors, sources)]


def _equal_rows(sizes) -> None:
    if sizes is not None and len(set(sizes)) > 1:
        raise ValueError("the backend's own reduce-scatter and all-gather take equal rows: pad, or use the ring")


WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def wire_dtype(comm_dtype) -> torch.dtype | None:
    """torch's dtype for a `strategy.comm_dtype` name (None, fp32, bf16, fp16); None means "as is"."""
    if comm_dtype is None:
        return None
    name = str(comm_dtype)
    if name not in WIRE_DTYPES:
        raise ValueError(f"comm_dtype must be one of {', '.join(WIRE_DTYPES)}, got {comm_dtype!r}")
    return WIRE_DTYPES[name]


def casts(tensor: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """True when sending `tensor` in `dtype` means a cast (a copy in a narrower dtype)."""
    return dtype is not None and dtype != tensor.dtype


def to_wire(tensor: torch.Tensor, dtype: torch.dtype | None, world_size: int) -> torch.Tensor:
    """What to send for a mean of `tensor`: `tensor / world_size`, in place when no cast is asked,
    else a new tensor in `dtype` (one rounding: divided in fp32, written in `dtype`)."""
    if not casts(tensor, dtype):
        return tensor.div_(world_size)
    wire = torch.empty(tensor.shape, dtype=dtype, device=tensor.device)
    return torch.div(tensor, world_size, out=wire)


def from_wire(wire: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """Land the reduced wire tensor in `tensor` (fp32); nothing to do when it was sent in place."""
    if wire.data_ptr() != tensor.data_ptr():
        tensor.copy_(wire)
    return tensor


def all_reduce_mean_(tensor: torch.Tensor, group=None, dtype: torch.dtype | None = None,
                     divisor: int | None = None) -> None:
    """Average in place over ranks. Gloo has no ReduceOp.AVG: uncast, sum then divide (one code path
    for both backends); in a narrower `dtype`: divide, cast, sum, uncast. `divisor`: what the sum is divided by
    (the replica map's, strategies/replicas.py; None: the group's size)."""
    divisor = divisor or dist.get_world_size(group)
    if not casts(tensor, dtype):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        tensor.div_(divisor)
        return
    wire = to_wire(tensor, dtype, divisor)
    dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group)
    from_wire(wire, tensor)


def wire_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes `tensor` takes on the wire in `dtype` (its own dtype when None)."""
    element = torch.empty((), dtype=dtype).element_size() if casts(tensor, dtype) else tensor.element_size()
    return tensor.numel() * element


def flat_all_reduce_mean_(grads: list[torch.Tensor], comm: CommStats, dtype: torch.dtype | None = None,
                          group=None, divisor: int | None = None) -> None:
    """Average `grads` in place over `group` with one all-reduce of a flattened copy: one call's latency for all."""
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    with comm.timed(wire_bytes(flat, dtype)):
        all_reduce_mean_(flat, group=group, dtype=dtype, divisor=divisor)
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


def all_reduce_mean_async(tensor: torch.Tensor, dtype: torch.dtype | None = None, group=None,
                          divisor: int | None = None) -> tuple[torch.futures.Future, Stamp]:
    """Divide by the group's size (or `divisor`), launch a SUM all-reduce (of a `dtype` copy when that casts); return
    (future of `tensor` holding the mean, its stamp). The copy back into `tensor` runs in the
    future's callback, as torch's fp16_compress_hook's decompress does (on CUDA: on the
    collective's stream, after it)."""
    return _sum_async(tensor, to_wire(tensor, dtype, divisor or dist.get_world_size(group)), group=group)


def all_reduce_sum_async(tensor: torch.Tensor, dtype: torch.dtype | None = None, group=None
                         ) -> tuple[torch.futures.Future, Stamp]:
    """Launch a SUM all-reduce of `tensor` over `group` as it is (the caller divides what must become a mean),
    sent in `dtype` (a cast copy, landed back in `tensor` by the future's callback)."""
    return _sum_async(tensor, tensor.to(dtype) if casts(tensor, dtype) else tensor, group=group)


def two_level_all_reduce_mean_async(tensor: torch.Tensor, node_group, across_group,
                                    dtype: torch.dtype | None = None) -> tuple[torch.futures.Future, Stamp]:
    """As `all_reduce_mean_async`, in two levels (rings.py's `ring_two_level_all_reduce`: inside the node,
    across nodes, inside the node again); one collective in the figures, of the message's bytes."""
    wire = to_wire(tensor, dtype, dist.get_world_size())
    return _sum_async(tensor, wire, lambda: ring_two_level_all_reduce(wire, node_group, across_group, async_op=True))


def _sum_async(tensor: torch.Tensor, wire: torch.Tensor, launch=None, group=None
               ) -> tuple[torch.futures.Future, Stamp]:
    """Launch the SUM all-reduce of `wire` (`tensor` itself, or its copy to send) over `group`, landing in
    `tensor`; `launch` (returning a work) replaces the flat all-reduce."""
    launch = launch or (lambda: dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group, async_op=True))
    future, stamp = launch_stamped(lambda: [launch()], tensor_bytes(wire), tensor.is_cuda)
    if wire is tensor:
        return future, stamp

    def land(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # raises if the collective failed
        return from_wire(wire, tensor)

    return future.then(land), stamp


def launch_stamped(launch, nbytes: int, on_cuda: bool) -> tuple[torch.futures.Future, Stamp]:
    """Run `launch()` (it starts async collectives and returns their works or futures) under one `Stamp`.

    The returned future completes when every work has; waiting on it raises if one failed. On
    CUDA pass a single work: its future's callback runs on the collective's stream, where the
    end event must be recorded (a combined future of several would lose that stream).
    """
    stamp = Stamp(nbytes)
    timed = per_collective()  # off: the collective is counted, and no clock, event or callback is added to it
    if on_cuda and timed:
        stamp.start_event = torch.cuda.Event(enable_timing=True)
        stamp.start_event.record()
    if timed:
        stamp.start = time.perf_counter()
    works = launch()
    stamp.calls = len(works)
    try:  # works of collectives, or futures (a comm hook of torch's returns one)
        futures = [w.get_future() if hasattr(w, "get_future") else w for w in works]
    except RuntimeError:  # gloo's reduce_scatter (built from all-reduce) has no future
        waited = _WaitedWorks(works, stamp)
        track(waited)  # it has done(), all the exit drain asks of what it tracks
        return waited, stamp
    if on_cuda and len(futures) != 1:
        raise ValueError("launch_stamped on CUDA times exactly one collective")
    combined = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)
    if not timed and len(futures) == 1 and not on_cuda:
        track(combined)  # the exit drain waits for it (gloo completes it on its own thread)
    if not timed and len(futures) == 1:
        return _Unwrapped(combined), stamp

    def done(fut: torch.futures.Future):
        if on_cuda:
            stamp.end_event = torch.cuda.Event(enable_timing=True)
            stamp.end_event.record()
        else:
            stamp.end = time.perf_counter()
        value = fut.value()  # raises here, and so in wait(), if the collective failed
        if len(futures) > 1:
            return [f.value() for f in value]
        return value[0] if isinstance(value, list) else value  # a work's future holds a list

    future = combined.then(done)
    track(future)  # waited for at exit, before the interpreter is torn down (exit_drain.py)
    return future, stamp


class _Unwrapped:
    """A collective's own future, its value as `launch_stamped`'s callback would give it (a work's future holds
    a list of its tensors), with no callback chained on it: what per-collective figures off return."""

    def __init__(self, future):
        self.future = future

    def done(self) -> bool:
        return self.future.done()

    def wait(self):
        value = self.future.wait()
        return value[0] if isinstance(value, list) else value

    def value(self):
        value = self.future.value()
        return value[0] if isinstance(value, list) else value

    def then(self, callback):
        return self.future.then(lambda fut: callback(self))


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


def broadcast_module_state(module: torch.nn.Module, src: int = 0, group=None) -> None:
    """Copy every parameter and buffer (frozen ones too) from `group`'s rank `src` (None: the world's), so all its
    ranks start identical.

    Tied parameters appear once in `parameters()`, so each storage is sent once.
    """
    root = global_rank(group, src)
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=root, group=group)
