"""The conjugate operators of Megatron-style tensor parallelism, written as autograd functions over the TP group.

Megatron's pairs (Shoeybi et al. 2019, "f" and "g"; Korthikanti et al. 2022 for the sequence-parallel ones):

| function | forward | backward |
|---|---|---|
| `copy_to_region` (f) | identity | all-reduce of the gradient |
| `reduce_from_region` (g) | all-reduce | identity |
| `gather_sequence` | all-gather along the sequence | reduce-scatter along the sequence |
| `reduce_scatter_sequence` | reduce-scatter along the sequence | all-gather along the sequence |

Each is its own conjugate's transpose: what forward sums, backward copies, and the reverse. A region of
column-parallel layers is entered by f (or the gather) and left by a row-parallel layer's g (or the
reduce-scatter), so forward and backward each pay one collective per region boundary.

Every call is blocking and on the critical path of forward or backward: `TPContext.comm` (a `CommStats`)
times it from its start to its end (the device synchronized on both sides on CUDA), so the TP axis's time
is exposed time, all of it. Reduce-scatter and all-gather take `backend.collectives`' implementation (the
lab's rings on gloo), as every data-parallel strategy's do.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ddp_lab.spec.parallel import SEQUENCE_DIM
from ddp_lab.strategies.collectives import all_gather, collectives_in_use, reduce_scatter
from ddp_lab.strategies.comm_stats import CommStats
from ddp_lab.units import tensor_bytes


@dataclass
class TPContext:
    """What the TP layers share: the group, this rank's place in it, sequence parallelism and the figures."""

    group: object
    size: int
    rank: int
    sequence_parallel: bool
    comm: CommStats
    collectives: str = "native"
    calls: Counter = field(default_factory=Counter)
    """Calls and bytes by op since the last `totals()`, for the tests that hold them to the schedule."""
    bytes: Counter = field(default_factory=Counter)

    @classmethod
    def over(cls, group, sequence_parallel: bool, device: torch.device) -> TPContext:
        return cls(group, dist.get_world_size(group), dist.get_rank(group), sequence_parallel, CommStats(device),
                   collectives_in_use(group))

    @contextmanager
    def timed(self, op: str, nbytes: int):
        self.calls[op] += 1
        self.bytes[op] += nbytes
        with self.comm.timed(nbytes):
            yield

    def totals(self) -> dict:
        """{"calls", "bytes", "by_op"} since the last call (spec/parallel.py's `schedule_totals`' shape)."""
        by_op = {op: {"calls": self.calls[op], "bytes": self.bytes[op]} for op in self.calls}
        self.calls, self.bytes = Counter(), Counter()
        return {"calls": sum(e["calls"] for e in by_op.values()), "bytes": sum(e["bytes"] for e in by_op.values()),
                "by_op": by_op}


def _all_reduce(x: torch.Tensor, ctx: TPContext, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """A new tensor (never in place: autograd may still read `x`, as torch's functional collectives never write
    their input either)."""
    x = x.clone(memory_format=torch.contiguous_format)
    with ctx.timed("all_reduce", tensor_bytes(x)):
        dist.all_reduce(x, op=op, group=ctx.group)
    return x


def _gather(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """(b, s, ...) shards of the sequence -> (b, size * s, ...), rank order."""
    x = x.movedim(SEQUENCE_DIM, 0).contiguous()
    out = torch.empty((ctx.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    with ctx.timed("all_gather", tensor_bytes(out)):
        all_gather(out.view(-1), x.view(-1), group=ctx.group, implementation=ctx.collectives)
    return out.movedim(0, SEQUENCE_DIM).contiguous()


def _reduce_scatter(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """(b, t, ...) partial sums -> this rank's (b, t / size, ...) of their sum."""
    rows = x.movedim(SEQUENCE_DIM, 0).contiguous()
    out = torch.empty((rows.shape[0] // ctx.size, *rows.shape[1:]), dtype=x.dtype, device=x.device)
    with ctx.timed("reduce_scatter", tensor_bytes(rows)):
        reduce_scatter(out.view(-1), rows.view(-1), group=ctx.group, implementation=ctx.collectives)
    return out.movedim(0, SEQUENCE_DIM).contiguous()


def _identity(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x.view_as(x)


class _Conjugate(torch.autograd.Function):
    """`forward(x)` forward, `backward(grad)` backward: one of the module docstring's pairs."""

    @staticmethod
    def forward(ctx, x, tp, forward, backward):
        ctx.tp, ctx.backward_of = tp, backward
        return forward(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_of(grad, ctx.tp), None, None, None


@torch.compiler.disable  # under train.compile: a graph break, the collective run eager (timed)
def copy_to_region(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _Conjugate.apply(x, tp, _identity, _all_reduce)


@torch.compiler.disable  # under train.compile: a graph break, the collective run eager (timed)
def reduce_from_region(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _Conjugate.apply(x, tp, _all_reduce, _identity)


@torch.compiler.disable  # under train.compile: a graph break, the collective run eager (timed)
def gather_sequence(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _Conjugate.apply(x, tp, _gather, _reduce_scatter)


@torch.compiler.disable  # under train.compile: a graph break, the collective run eager (timed)
def reduce_scatter_sequence(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _Conjugate.apply(x, tp, _reduce_scatter, _gather)


def enter_region(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """The input of a column-parallel region made whole on every rank: f, or the sequence all-gathered."""
    return gather_sequence(x, tp) if tp.sequence_parallel else copy_to_region(x, tp)


def leave_region(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """A row-parallel region's partial outputs summed: g, or reduce-scattered over the sequence."""
    return reduce_scatter_sequence(x, tp) if tp.sequence_parallel else reduce_from_region(x, tp)


def all_reduce_max(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """An element-wise max over the TP ranks (no gradient: the loss uses it as a constant shift)."""
    return _all_reduce(x.detach(), tp, dist.ReduceOp.MAX)


def all_reduce_sum(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _all_reduce(x, tp)
