"""torch's own ring attention, beside the lab's: `_templated_ring_attention` and its backward from
torch.distributed.tensor.experimental, called with the model's attention kernel over the zigzag split.

torch's public `context_parallel()` does not run on the CPU (its DTensor dispatch has no sharding rule for
`aten._scaled_dot_product_flash_attention_for_cpu`), so the lab calls the template its public API is built on,
as torch's own CPU-less tests cannot: load balancing on (torch's "round robin" split is the lab's zigzag: rank r
holds chunks r and 2W-1-r, and the launcher refuses a context that does not divide by 2W, where torch would turn
balancing off silently), `convert_to_f32` off (on, it rounds every block's output and gradient through fp32: 1.8e-7
in float64 instead of 1.6e-15). Its K/V rotation is its default, an all-gather once per call. The options are
torch's module globals: set around each call and put back.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ddp_lab.context_parallel.exchange import Tally
from ddp_lab.spec.context import exchange_bytes

aten = torch.ops.aten


@contextmanager
def _options():
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    saved = (cp._cp_options.convert_to_f32, cp._cp_options.enable_load_balance)
    cp._cp_options.convert_to_f32, cp._cp_options.enable_load_balance = False, True
    try:
        yield cp
    finally:
        cp._cp_options.convert_to_f32, cp._cp_options.enable_load_balance = saved


def _kernels(device: torch.device):
    if device.type != "cpu":
        raise NotImplementedError("parallel.cp_impl=torch calls torch's template with the CPU flash-attention kernel; "
                                  "on CUDA torch's public context_parallel() is the way, not wired here yet")
    return aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward


class TorchRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, size: int, tally: Tally):
        forward_op, _ = _kernels(q.device)
        with _options() as cp:
            out, lse = cp._templated_ring_attention(group, 2, forward_op, q, k, v, is_causal=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.size, ctx.tally = group, size, tally
        _count(tally, q, k, size, "forward")
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        _, backward_op = _kernels(q.device)
        with _options() as cp:
            dq, dk, dv = cp._templated_ring_attention_backward(
                ctx.group, 2, backward_op, dout.contiguous(), "grad_out", q, k, v, out, lse, is_causal=True,
                dropout_p=0.0)[:3]
        _count(ctx.tally, q, k, ctx.size, "backward")
        return dq, dk, dv, None, None, None


def _count(tally: Tally, q, k, size: int, phase: str) -> None:
    """torch's exchange is inside its template, where no hook of the lab's is: its bytes by spec/context.py's
    formula read from its source (an all-gather of K/V per pass, W rotations of dK/dV)."""
    b, h, s, d = k.shape
    tally.sent[phase] += exchange_bytes("torch", size, 1, b * s, q.shape[1] * d, h * d, k.element_size())[phase]
    if phase == "forward":
        tally.calls += 1


def torch_ring_attention(q, k, v, group, size: int, tally: Tally) -> torch.Tensor:
    return TorchRing.apply(q, k, v, group, size, tally)
