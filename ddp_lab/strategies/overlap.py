"""OverlapDDP: one async all-reduce per parameter, launched as soon as its gradient is accumulated.

Communication of the last layers' gradients runs while backward computes the first layers', so
only the tail (the gradients finished last) is left exposed after backward. The price is one
collective per parameter, each paying the fixed per-call latency that BucketedDDP amortizes.
The all-reduce runs in place on `.grad`: no buffer, no copy. Hook, ordering, unused-parameter and
no_sync rules are in overlap_engine.py.
"""

from __future__ import annotations

import torch
from torch import nn

from ddp_lab.strategies.overlap_engine import OverlapEngine


class OverlapDDP(OverlapEngine):
    def __init__(self, module: nn.Module, comm_dtype: str = "fp32", process_group=None, replicas=None):
        trainable = [p for p in module.parameters() if p.requires_grad]
        super().__init__(module, [[p] for p in reversed(trainable)], comm_dtype, process_group, replicas)

    def _stage(self, param: nn.Parameter) -> None:
        if param.grad is None:
            param.grad = torch.zeros_like(param)  # no gradient on this rank: contribute zeros
        elif not param.grad.is_contiguous():
            param.grad = param.grad.contiguous()  # collectives need dense memory

    def _unit_tensor(self, index: int) -> torch.Tensor:
        return self._units[index][0].grad
