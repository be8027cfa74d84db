"""Ring attention, written by hand: each rank's queries against every rank's keys and values, the K/V blocks
passed around the ring, the partial results merged by their log-sum-exps; the backward by hand too.

Forward: the rank holds its queries, keys and values (one chunk of the sequence, or two under the zigzag split).
At each of the ring's W steps it posts the block it holds to the next member (and receives the previous
member's) before computing it, so the exchange can hide under that block's attention; a block of keys later in
the sequence than a chunk of queries is skipped (never computed: the causal mask covers it whole), the diagonal
block is causal, an earlier one full.

Backward: the keys and values go around again (they were not kept: memory), and each block's dK/dV travels with
it: started at zero by the first member after its owner, each member adds its share, and after W-1 hops it
reaches its owner, who adds its own. The whole exchange is inside one autograd Function: no rank's backward waits
on a peer whose backward autograd never runs (differentiating through send/recv hangs exactly so when the mask
skips a rank's last received block).
"""

from __future__ import annotations

import torch

from ddp_lab.context_parallel.exchange import Ring
from ddp_lab.context_parallel.kernel import attend, attend_backward, merge
from ddp_lab.spec.context import chunks_of

KV_TAG, GRAD_TAG = 71, 72


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _pairs(mine: list[int], theirs: list[int]):
    """(my chunk's place, their chunk's place, causal) of every block pair to compute: their chunk j not later
    than my chunk i."""
    return [(a, b, j == i) for a, i in enumerate(mine) for b, j in enumerate(theirs) if j <= i]


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, layout: str):
        w, member = ring.size, ring.member
        mine = chunks_of(member, w, layout)
        chunk = q.shape[2] // len(mine)
        qs = q.split(chunk, dim=2)
        outs, lses = [None] * len(mine), [None] * len(mine)
        acc = _accumulation_dtype(q.dtype)
        ring.tally.phase = "forward"
        ring.tally.blocks.append((k.shape, k.dtype, acc))
        k_cur, v_cur, src = k.contiguous(), v.contiguous(), member
        for t in range(w):
            posted = ring.post([k_cur, v_cur], KV_TAG) if t < w - 1 else None
            ks, vs = k_cur.split(chunk, dim=2), v_cur.split(chunk, dim=2)
            for a, b, causal in _pairs(mine, chunks_of(src, w, layout)):
                o, lse = ring.tally.timed(attend, qs[a], ks[b], vs[b], causal)
                outs[a], lses[a] = merge(outs[a], lses[a], o.to(acc), lse)
                ring.tally.pairs += (chunk * (chunk + 1) // 2 if causal else chunk * chunk) * q.shape[1]
            if posted is not None:
                k_cur, v_cur = posted.wait()
                src = (src - 1) % w
        out, lse = torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)
        ring.tally.calls += 1
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.layout, ctx.chunk = ring, layout, chunk
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, layout, chunk = ctx.ring, ctx.layout, ctx.chunk
        w, member = ring.size, ring.member
        mine = chunks_of(member, w, layout)
        acc = _accumulation_dtype(q.dtype)
        qs, outs, douts = q.split(chunk, 2), out.split(chunk, 2), dout.contiguous().split(chunk, 2)
        lses = [part.contiguous() for part in lse.split(chunk, 2)]
        dqs = [torch.zeros_like(part, dtype=acc) for part in qs]
        ring.tally.phase = "backward"
        k_cur, v_cur, src = k.contiguous(), v.contiguous(), member
        own = carried = None  # my block's dK/dV; the gradients of the block I hold, from the members before me
        for t in range(w):
            posted = ring.post([k_cur, v_cur], KV_TAG) if t < w - 1 else None
            ks, vs = k_cur.split(chunk, 2), v_cur.split(chunk, 2)
            dk, dv = torch.zeros_like(k_cur, dtype=acc), torch.zeros_like(v_cur, dtype=acc)
            dks, dvs = dk.split(chunk, 2), dv.split(chunk, 2)
            for a, b, causal in _pairs(mine, chunks_of(src, w, layout)):
                dq_, dk_, dv_ = ring.tally.timed(attend_backward, douts[a], qs[a], ks[b], vs[b], outs[a], lses[a],
                                                 causal)
                dqs[a] += dq_
                dks[b].add_(dk_)
                dvs[b].add_(dv_)
            if t == 0:
                own = (dk, dv)
            else:
                if carried is not None:
                    got_k, got_v = carried.wait()
                    dk, dv = dk + got_k, dv + got_v
                carried = ring.post([dk, dv], GRAD_TAG)  # on to the next member: its owner after the last step
            if posted is not None:
                k_cur, v_cur = posted.wait()
                src = (src - 1) % w
        dk, dv = own
        if carried is not None:
            got_k, got_v = carried.wait()
            dk, dv = dk + got_k, dv + got_v
        return torch.cat(dqs, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


class LocalAttention(torch.autograd.Function):
    """The causal attention over the tokens a rank holds whole (a Ulysses rank's heads), with the ring's kernel and
    its time counted forward and backward alike (autograd's SDPA would hide its backward from the tally)."""

    @staticmethod
    def forward(ctx, q, k, v, tally):
        out, lse = tally.timed(attend, q, k, v, True)
        s = q.shape[2]
        tally.pairs += s * (s + 1) // 2 * q.shape[1]
        tally.calls += 1
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.tally = tally
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.tally.timed(attend_backward, dout.contiguous(), q, k, v, out, lse, True)
        return dq, dk, dv, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, layout: str) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values, around `ring`; `layout`:
    "ring" (contiguous chunks) or "zigzag" (chunks r and 2W-1-r). q, k, v: (batch, heads, local tokens, head_dim)."""
    return RingAttention.apply(q, k, v, ring, layout)
