"""The lab's tensor-parallel layers, Megatron's, written by hand on the conjugate operators of comm.py.

Each is the nn.Linear or nn.Embedding it replaces (a subclass: the data-parallel strategies' unit plans and
policies still see a Linear), holding this rank's piece of the weight, cut by layout.py's `shard`:

- `ColumnParallelLinear`: output features split. No collective forward (each rank computes its slice of the
  output); its input enters the region by f (identity forward, all-reduce backward) or, under sequence
  parallelism, an all-gather of the sequence; a layer inside a module whose input was prepared once
  (`PrepareInput`: q/k/v, w1/w3) takes it as it comes.
- `RowParallelLinear`: input features split; the partial outputs are summed by g (all-reduce forward,
  identity backward), or reduce-scattered over the sequence; the bias is added once, after the sum (added on
  every rank before it, it would count tp times). Under sequence parallelism the bias is added to this rank's
  tokens only, so its gradient is summed over the TP ranks as a norm's is.
- `VocabParallelEmbedding`: rows of the (padded) vocabulary split; an id outside a rank's rows looks up
  zeros, and the ranks' outputs are summed as a row-parallel layer's.
- norms under sequence parallelism: run on the sequence shard as they are; their weight's gradient, a sum
  over this rank's tokens only, is summed over the TP ranks by f on the weight (`sum_weight_gradients`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddp_lab.tensor_parallel.comm import TPContext, copy_to_region, enter_region, leave_region
from ddp_lab.tensor_parallel.layout import Split, shard


def _piece(param: nn.Parameter | None, split: Split, tp: TPContext) -> nn.Parameter | None:
    if param is None:
        return None
    return nn.Parameter(shard(param.detach(), split, tp.size, tp.rank), requires_grad=param.requires_grad)


class ColumnParallelLinear(nn.Linear):
    def __init__(self, linear: nn.Linear, tp: TPContext, split: Split, own_input: bool, weight=None):
        """`linear`'s output features split as `split` says (this rank's rows of the weight and the bias);
        `own_input`: enter the region here (False inside a module whose input was prepared); `weight`: the piece
        a tied weight already has."""
        weight = weight if weight is not None else _piece(linear.weight, split, tp)
        super().__init__(weight.shape[1], weight.shape[0], bias=linear.bias is not None, device="meta")
        self.weight, self.bias = weight, _piece(linear.bias, Split(0, split.chunks, split.padded), tp)
        self.tp, self.own_input = tp, own_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.own_input:
            x = enter_region(x, self.tp)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    def __init__(self, linear: nn.Linear, tp: TPContext):
        """`linear`'s input features split: this rank's columns of the weight; the bias whole."""
        weight = _piece(linear.weight, Split(1), tp)
        super().__init__(weight.shape[1], weight.shape[0], bias=linear.bias is not None, device="meta")
        self.weight, self.bias, self.tp = weight, linear.bias, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = leave_region(F.linear(x, self.weight), self.tp)
        if self.bias is None:
            return y
        return y + (copy_to_region(self.bias, self.tp) if self.tp.sequence_parallel else self.bias)


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, embedding: nn.Embedding, tp: TPContext, split: Split, weight=None):
        """`embedding`'s rows (the vocabulary, padded to `split.padded`) split: this rank holds ids
        [vocab_start, vocab_start + num_embeddings)."""
        weight = weight if weight is not None else _piece(embedding.weight, split, tp)
        super().__init__(weight.shape[0], weight.shape[1], device="meta")
        self.weight, self.tp = weight, tp
        self.vocab_start = tp.rank * weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.num_embeddings)
        rows = F.embedding((ids - self.vocab_start).masked_fill(outside, 0), self.weight)
        return leave_region(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.tp)


def sum_weight_gradients(module: nn.Module, tp: TPContext) -> None:
    """Under sequence parallelism a norm sees only this rank's tokens, so its parameters' gradients are partial:
    each forward runs with f (identity forward, all-reduce backward) on every parameter, so the gradient that
    reaches the parameter is summed over the TP ranks."""
    names = [name for name, p in module.named_parameters(recurse=False) if p.requires_grad]
    if names:
        in_forward(module, {name: (lambda p: copy_to_region(p, tp)) for name in names})


def in_forward(module: nn.Module, views: dict) -> None:
    """During each forward of `module`, `views[name](parameter)` stands in the place of each named parameter,
    which is put back after it: the parameters themselves (their names, their hooks, what optimizers and
    strategies hold) never change, and gradients reach them through the views' backward. The views are made
    inside the module's forward itself, so a strategy's forward hooks around it (the lab's FSDP and FSDP2 gather
    a unit's parameters before its forward, free them after) have put their own parameter in place first, and
    that is what is viewed and put back."""
    inner = module.forward

    def forward(*args, **kwargs):
        held = {name: module._parameters[name] for name in views}
        for name, view in views.items():
            module._parameters[name] = view(held[name])
        try:
            return inner(*args, **kwargs)
        finally:
            module._parameters.update(held)

    module.forward = forward


def prepare_input(module: nn.Module, tp: TPContext) -> None:
    """The module's first input enters the region once, for every column-parallel layer inside it."""

    def enter(mod, args):
        return (enter_region(args[0], tp), *args[1:])

    module.register_forward_pre_hook(enter)
