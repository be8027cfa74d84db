"""Ulysses (DeepSpeed-Ulysses), written by hand: an all-to-all turns a rank's tokens of every head into every
token of its heads, attention runs over the whole sequence (or a hybrid's group's tokens) for those heads, and an
all-to-all turns it back. Each all-to-all's backward is the all-to-all the other way.

Every buffer handed to `all_to_all_single` is made contiguous, and each output is a fresh `torch.empty` of the
exchanged shape: an output made with `empty_like` of a permuted tensor keeps the permuted strides, and the
collective, which writes it as a flat buffer, scrambles the heads and tokens silently.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ddp_lab.context_parallel.exchange import Tally


def _exchange(x: torch.Tensor, group, tally: Tally) -> torch.Tensor:
    """all_to_all_single over `group` of x laid out (U, ...): part j goes to member j, part j of the result came
    from member j. A member sends (U-1)/U of x's bytes."""
    size = x.shape[0]
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    start = time.perf_counter()
    dist.all_to_all_single(out, x, group=group)  # blocking: all of it is exposed
    tally.exposed_s += time.perf_counter() - start
    tally.sent[tally.phase] += x.numel() * x.element_size() * (size - 1) // size
    return out


def sequence_to_heads(x: torch.Tensor, group, size: int, tally: Tally) -> torch.Tensor:
    """(batch, heads, tokens, d) of this rank's tokens -> (batch, heads / size, size x tokens, d): the group's
    tokens, in its members' order, of this rank's share of the heads."""
    b, h, s, d = x.shape
    parts = x.reshape(b, size, h // size, s, d).permute(1, 0, 2, 3, 4)
    got = _exchange(parts, group, tally)  # got[j]: member j's tokens of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def heads_to_sequence(x: torch.Tensor, group, size: int, tally: Tally) -> torch.Tensor:
    """The inverse: (batch, heads / size, size x tokens, d) -> (batch, heads, tokens, d)."""
    b, h, s, d = x.shape
    parts = x.reshape(b, h, size, s // size, d).permute(2, 0, 1, 3, 4)
    got = _exchange(parts, group, tally)  # got[j]: my tokens of member j's heads
    return got.permute(1, 0, 2, 3, 4).reshape(b, h * size, s // size, d)


class AllToAll(torch.autograd.Function):
    """`sequence_to_heads` (`to_heads`) or `heads_to_sequence`, whose backward is the other one."""

    @staticmethod
    def forward(ctx, x, group, size: int, tally: Tally, to_heads: bool):
        ctx.group, ctx.size, ctx.tally, ctx.to_heads = group, size, tally, to_heads
        tally.phase = "forward"
        return (sequence_to_heads if to_heads else heads_to_sequence)(x, group, size, tally)

    @staticmethod
    def backward(ctx, grad):
        ctx.tally.phase = "backward"
        back = heads_to_sequence if ctx.to_heads else sequence_to_heads
        return back(grad, ctx.group, ctx.size, ctx.tally), None, None, None, None


def ulysses_attention(q, k, v, group, size: int, tally: Tally, attend) -> torch.Tensor:
    """Causal attention of this rank's tokens by way of heads: q, k, v to head shards, `attend(q, k, v)` over the
    group's tokens (the model's attention, or a ring across groups), the output back to this rank's tokens."""
    q, k, v = (AllToAll.apply(t, group, size, tally, True) for t in (q, k, v))
    return AllToAll.apply(attend(q, k, v), group, size, tally, False)
