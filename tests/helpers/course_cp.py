"""Context-parallel attentions written as a student would, for `python -m ddp_lab.check ... --cp 2,4`: two right
ones (K and V all-gathered with autograd, the mask from global positions; Ulysses over all-to-alls) and the wrong
versions the check must name (each a one-line change of a right one).

`torch_all_gather_attention` is the first written with torch's own differentiable all-gather
(`torch.distributed.nn.functional.all_gather`, deprecated): on gloo its backward hands the incoming gradient to
`all_to_all` without making it contiguous, and a gradient that arrives transposed (K's, from q @ K^T) is sent as
its storage lies: dK comes out scrambled while dV is right. The check found it; the right version gathers with a
Function of its own whose backward all-reduces a contiguous gradient."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn


def _positions(rank: int, size: int, local: int, layout: str) -> torch.Tensor:
    if layout == "zigzag":
        half = local // 2
        return torch.cat([torch.arange(rank * half, (rank + 1) * half),
                          torch.arange((2 * size - 1 - rank) * half, (2 * size - rank) * half)])
    return torch.arange(rank * local, (rank + 1) * local)


class _Gather(torch.autograd.Function):
    """Every rank's x along the sequence; backward: the gradient summed over the ranks (all-reduce), this rank's
    share kept."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.local = group, dist.get_rank(group), x.shape[2]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, :, ctx.rank * ctx.local:(ctx.rank + 1) * ctx.local], None


def _gathered(x, group, torch_gather: bool = False):
    if torch_gather:
        return torch.cat(dnn.all_gather(x.contiguous(), group=group), dim=2)
    return _Gather.apply(x, group)


def _softmax_attention(q, k, v, mask):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def all_gather_attention(q, k, v, group, causal, layout="contiguous", torch_gather=False):
    """Every rank's K and V gathered (the gather's backward sums each rank's dK/dV back to its owner), the causal
    mask from the tokens' global positions."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    keys, values = _gathered(k, group, torch_gather), _gathered(v, group, torch_gather)
    local = q.shape[2]
    mine = _positions(rank, size, local, layout)
    every = torch.cat([_positions(r, size, local, layout) for r in range(size)])
    mask = mine[:, None] >= every[None, :] if causal else None
    return _softmax_attention(q, keys, values, mask)


def torch_all_gather_attention(q, k, v, group, causal):
    """all_gather_attention on torch's differentiable all-gather (module docstring: its dK is scrambled on gloo)."""
    return all_gather_attention(q, k, v, group, causal, torch_gather=True)


def keeps_own_grads(q, k, v, group, causal, layout="contiguous"):
    """Wrong: the other ranks' K and V gathered without autograd, so dK/dV stay where they were computed."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    parts = [torch.empty_like(k) for _ in range(size)]
    dist.all_gather(parts, k.detach().contiguous(), group=group)
    parts_v = [torch.empty_like(v) for _ in range(size)]
    dist.all_gather(parts_v, v.detach().contiguous(), group=group)
    parts[rank], parts_v[rank] = k, v
    local = q.shape[2]
    mine = _positions(rank, size, local, layout)
    every = torch.cat([_positions(r, size, local, layout) for r in range(size)])
    mask = mine[:, None] >= every[None, :] if causal else None
    return _softmax_attention(q, torch.cat(parts, 2), torch.cat(parts_v, 2), mask)


def averages_blocks(q, k, v, group, causal):
    """Wrong: each rank's block of keys attended with its own softmax, the blocks' outputs averaged (no
    log-sum-exp)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    keys, values = _gathered(k, group).split(q.shape[2], dim=2), _gathered(v, group).split(q.shape[2], dim=2)
    local = q.shape[2]
    outs = []
    for j in range(size if not causal else rank + 1):
        mask = torch.ones(local, local, dtype=torch.bool).tril() if causal and j == rank else None
        outs.append(_softmax_attention(q, keys[j], values[j], mask))
    return sum(outs) / len(outs)


def masks_every_block(q, k, v, group, causal):
    """Wrong: the diagonal's causal mask applied to every earlier block too (by position within the block)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    keys, values = _gathered(k, group), _gathered(v, group)
    local = q.shape[2]
    tril = torch.ones(local, local, dtype=torch.bool).tril()
    mask = torch.cat([tril if j <= rank else torch.zeros_like(tril) for j in range(size)], dim=1) if causal else None
    return _softmax_attention(q, keys, values, mask)


def receives_first(q, k, v, group, causal):
    """Wrong: every rank receives its neighbour's keys before sending its own: all wait, none sends."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    got = torch.empty_like(k)
    dist.recv(got, src=(rank - 1) % size)
    dist.send(k.detach().contiguous(), dst=(rank + 1) % size)
    return all_gather_attention(q, k, v, group, causal)


class _ToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return _to_heads(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _to_tokens(grad, ctx.group, ctx.size, scramble=False), None, None


class _ToTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, scramble):
        ctx.group, ctx.size = group, size
        return _to_tokens(x, group, size, scramble)

    @staticmethod
    def backward(ctx, grad):
        return _to_heads(grad, ctx.group, ctx.size), None, None, None


def _to_heads(x, group, size):
    b, h, s, d = x.shape
    parts = x.reshape(b, size, h // size, s, d).permute(1, 0, 2, 3, 4).contiguous()
    out = torch.empty_like(parts)
    dist.all_to_all_single(out, parts, group=group)
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def _to_tokens(x, group, size, scramble):
    b, h, s, d = x.shape
    parts = x.reshape(b, h, size, s // size, d).permute(2, 0, 1, 3, 4)
    out = torch.empty_like(parts) if scramble else torch.empty(parts.shape, dtype=x.dtype)  # the trap: strides kept
    dist.all_to_all_single(out, parts.contiguous(), group=group)
    return out.permute(1, 0, 2, 3, 4).reshape(b, h * size, s // size, d)


def ulysses_attention(q, k, v, group, causal, scramble=False):
    """Ulysses: tokens to heads, the whole sequence's attention for this rank's heads, heads back to tokens."""
    size = dist.get_world_size(group)
    q, k, v = (_ToHeads.apply(t, group, size) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return _ToTokens.apply(out, group, size, scramble)


def ulysses_scrambled(q, k, v, group, causal):
    """Wrong: the all-to-all back to tokens written into empty_like of a permuted tensor."""
    return ulysses_attention(q, k, v, group, causal, scramble=True)
