"""The attention of one block of queries against one block of keys, with its log-sum-exp: what a ring merges.

The model attends with `F.scaled_dot_product_attention`; on the CPU that dispatches to
`aten._scaled_dot_product_flash_attention_for_cpu`, which also returns the log-sum-exp of each query's scores,
and whose backward takes the merged output and log-sum-exp of a whole ring (its probabilities are recomputed from
them: exp(score - lse)), so each block's gradient is the one the whole attention would give. Those are the
kernels used here on the CPU, the model's own. Elsewhere (CUDA) the same two functions are written in their math
form: correct in every dtype, not flash-fast; torch's flash kernels on CUDA are not proven here yet.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q (batch, heads, sq, d) against k, v (batch, heads, sk, d); `causal`: the diagonal block
    (sq = sk, query i sees keys 0..i). lse: (batch, heads, sq), in fp32 or the input's wider dtype."""
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse
    scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(_upper(scores), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype) @ v)
    return out, lse


def attend_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block, given the whole attention's output `out`, its log-sum-exp `lse` and `dout` for
    the block's queries: P = exp(q k^T / sqrt(d) - lse), dS = P (dout v^T - rowsum(dout * out))."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)
    scale = 1 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)).float() * scale
    if causal:
        scores = scores.masked_fill(_upper(scores), float("-inf"))
    p = torch.exp(scores - lse.unsqueeze(-1))
    dv = p.to(dout.dtype).transpose(-2, -1) @ dout
    dp = (dout @ v.transpose(-2, -1)).float()
    delta = (dout.float() * out.float()).sum(-1, keepdim=True)
    ds = (p * (dp - delta) * scale).to(q.dtype)
    return ds @ k, ds.transpose(-2, -1) @ q, dv


def _upper(scores: torch.Tensor) -> torch.Tensor:
    n, m = scores.shape[-2:]
    return torch.ones(n, m, dtype=torch.bool, device=scores.device).triu(1)


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint keys, merged by their log-sum-exps: the softmax
    over the union, exactly (out = sum_i exp(lse_i - lse) out_i, lse = log(sum_i exp(lse_i)))."""
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    merged = (torch.exp(lse - new).unsqueeze(-1) * out + torch.exp(block_lse - new).unsqueeze(-1) * block_out)
    return merged.to(out.dtype), new
