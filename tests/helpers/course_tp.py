"""Tensor-parallel layers as a student completes the lecture's homework (its forward passes given, the backward
left to write): one right pair and one wrong version for each cause `python -m ddp_lab.check COLUMN,ROW --tp 2,4`
names (tests/e2e/test_check_tp.py; docs/check_tp.md)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class CopyToRegion(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the input's gradient over the TP ranks (each rank's
    column-parallel slice contributed only its part of it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class ReduceFromRegion(torch.autograd.Function):
    """Megatron's g: forward sums the partial outputs over the TP ranks; backward passes the gradient as it is
    (every rank's partial output had the same effect on the sum)."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class GatherSequence(torch.autograd.Function):
    """Sequence parallelism's entry: forward gathers every rank's tokens (dim 1); backward keeps this rank's
    tokens' part of the sum of the gradients (a reduce-scatter: an all-reduce, then this rank's slice)."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad.tensor_split(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()


class ScatterSequence(torch.autograd.Function):
    """Sequence parallelism's exit: forward sums the partial outputs and keeps this rank's tokens (a
    reduce-scatter); backward gathers every rank's tokens' gradient."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x.tensor_split(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, grad.contiguous())
        return torch.cat(parts, dim=1)


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    rank, size = dist.get_rank(), dist.get_world_size()
    return torch.tensor_split(t.detach(), size, dim=dim)[rank].clone()


class ColumnParallelLinear(nn.Module):
    """Right: this rank's rows of the weight and bias (its output features); the input enters through f, or, with
    `sequence_parallel`, every rank's tokens gathered."""

    def __init__(self, linear: nn.Linear, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(_rows(linear.weight, 0), requires_grad=linear.weight.requires_grad)
        self.bias = None if linear.bias is None else nn.Parameter(_rows(linear.bias, 0),
                                                                  requires_grad=linear.bias.requires_grad)

    def forward(self, x):
        x = GatherSequence.apply(x) if self.sequence_parallel else CopyToRegion.apply(x)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Right: this rank's columns of the weight (its input features), the bias whole, added once after g; with
    `sequence_parallel` the sum is reduce-scattered over the tokens, and the bias, added to this rank's tokens
    only, enters through f so that its gradient is summed over the ranks."""

    def __init__(self, linear: nn.Linear, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(_rows(linear.weight, 1), requires_grad=linear.weight.requires_grad)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=linear.bias.requires_grad)

    def forward(self, x):
        if self.sequence_parallel:
            y = ScatterSequence.apply(F.linear(x, self.weight))
            return y if self.bias is None else y + CopyToRegion.apply(self.bias)
        y = ReduceFromRegion.apply(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class ColumnWithoutInputAllReduce(ColumnParallelLinear):
    """The forward as the lecture gives it, and no f: each rank's input gradient is only its slice's part."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowBiasOnEveryRank(RowParallelLinear):
    """Adds the bias to its partial output before the sum: the sum holds it once per rank."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)

    def forward(self, x):
        return ReduceFromRegion.apply(F.linear(x, self.weight, self.bias))


class ColumnAlongTheInput(ColumnParallelLinear):
    """Takes the columns of nn.Linear's weight (the input features) for a column-parallel layer: the wrong
    dimension (the lecture's X @ A, with A = weight.T, split by columns, read on the stored weight)."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        self.weight = nn.Parameter(_rows(linear.weight, 1))

    def forward(self, x):
        x = torch.tensor_split(x, dist.get_world_size(), dim=-1)[dist.get_rank()]
        return F.linear(CopyToRegion.apply(x), self.weight, self.bias)


class TakesAGroup(ColumnParallelLinear):
    """Right, and takes its TP group by keyword, as code meant for a mesh does."""

    def __init__(self, linear: nn.Linear, group=None):
        assert group is not None, "the check passes the TP group where the constructor takes one"
        super().__init__(linear)


class ColumnTrainsFrozen(ColumnParallelLinear):
    """Makes its pieces trainable whatever the layer was (nn.Parameter's default): a frozen layer trains."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        self.weight.requires_grad_(True)


class ColumnRefusesUneven(ColumnParallelLinear):
    """Right, and refuses output features the TP degree does not divide, as Megatron does."""

    def __init__(self, linear: nn.Linear):
        if linear.out_features % dist.get_world_size():
            raise ValueError(f"out_features {linear.out_features} is not divisible by the TP degree "
                             f"{dist.get_world_size()}")
        super().__init__(linear)


class RowSequenceBiasNotSummed(RowParallelLinear):
    """Sequence parallel, right but for the bias: added to this rank's tokens only, its gradient is never summed
    over the ranks."""

    def forward(self, x):
        if not self.sequence_parallel:
            return super().forward(x)
        y = ScatterSequence.apply(F.linear(x, self.weight))
        return y + self.bias
