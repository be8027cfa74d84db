"""Tensor-parallel layers built as frameworks build them: from sizes and a group, each drawing its own weights
(Megatron's `ColumnParallelLinear(input_size, output_size, bias, ...)`, picotron's and most teaching frameworks'
`(in_features, out_features, bias, group)`), every collective over the group it was given. One right pair and the
global-rank bug, checked on a dp x tp mesh by `python -m ddp_lab.check COLUMN,ROW --tp 2` (tests/e2e/test_check_tp.py;
docs/check_tp.md)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _Copy(torch.autograd.Function):
    """Identity forward; backward sums the input's gradient over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    """Forward sums the partial outputs over the group; backward passes the gradient as it is."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _master_weight(out_features: int, in_features: int) -> torch.Tensor:
    """The whole weight, drawn on every rank from the same generator state (as Megatron's CPU initialization does),
    of which each rank keeps its piece."""
    weight = torch.empty(out_features, in_features)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    return weight


class SizedColumn(nn.Module):
    """Right: `(in_features, out_features, bias, group)`; this group rank's rows of a weight it draws itself."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None):
        super().__init__()
        self.group = group
        size, rank = dist.get_world_size(group), self._rank()
        if out_features % size:
            raise ValueError(f"out_features {out_features} is not divisible by the group's {size} ranks")
        rows = out_features // size
        self.weight = nn.Parameter(_master_weight(out_features, in_features)[rank * rows:(rank + 1) * rows].clone())
        self.bias = nn.Parameter(torch.zeros(rows)) if bias else None

    def _rank(self) -> int:
        return dist.get_rank(self.group)

    def forward(self, x):
        return F.linear(_Copy.apply(x, self.group), self.weight, self.bias)


class SizedRow(nn.Module):
    """Right, in Megatron's keyword names: `(input_size, output_size, bias, tp_group)`; this group rank's columns of
    a weight it draws itself, the bias whole (zeros on every rank) and added once, after the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, tp_group=None):
        super().__init__()
        self.group = tp_group
        size, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        if input_size % size:
            raise ValueError(f"input_size {input_size} is not divisible by the group's {size} ranks")
        cols = input_size // size
        self.weight = nn.Parameter(_master_weight(output_size, input_size)[:, rank * cols:(rank + 1) * cols].clone())
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None

    def forward(self, x):
        y = _Reduce.apply(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class GlobalRankColumn(SizedColumn):
    """Keeps the rows of `dist.get_rank()`, the rank in the whole world, where its group's rank belongs: right when
    the group is every rank; on a mesh a rank past the first group slices past the end of the weight (no rows)."""

    def _rank(self) -> int:
        return dist.get_rank()


class SizedRowBiasOnEveryRank(SizedRow):
    """Wrong: adds its bias to each partial output before the sum, so the output carries it tp times. Its bias starts
    at zero (as Megatron's does), which hid the bug from the check until the bias had moved: a drift after 3 steps
    blamed on the steps, not the bias at step one."""

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return _Reduce.apply(y, self.group)


class UnsetColumn(SizedColumn):
    """Right once `reset_parameters()` has run; its constructor leaves the weight and bias as torch.empty made them,
    as frameworks that initialize later (a model's `init_weights`, or on the meta device) write it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None):
        super().__init__(in_features, out_features, bias, group)
        self.weight = nn.Parameter(torch.empty_like(self.weight))
        self.bias = nn.Parameter(torch.empty_like(self.bias)) if bias else None

    def reset_parameters(self) -> None:
        rows = self.weight.shape[0]
        rank = self._rank()
        with torch.no_grad():
            self.weight.copy_(_master_weight(rows * dist.get_world_size(self.group), self.weight.shape[1])
                              [rank * rows:(rank + 1) * rows])
            if self.bias is not None:
                self.bias.zero_()


class UnevenTypeError(SizedColumn):
    """Crashes on a size the group does not divide with a TypeError of its own making (a float where an int belongs),
    which is no refusal: the uneven case must not call it one."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None):
        size = dist.get_world_size(group)
        if out_features % size:
            torch.zeros(out_features / size)  # TypeError: a float size
        super().__init__(in_features, out_features, bias, group)


class ThreeDimensionalColumn(SizedColumn):
    """Right, and documented for (batch, sequence, features) inputs only: it says so, and the inputs_2d case skips."""

    takes_2d_inputs = False

    def forward(self, x):
        if x.ndim != 3:
            raise ValueError("ThreeDimensionalColumn takes (batch, sequence, features)")
        return super().forward(x)
