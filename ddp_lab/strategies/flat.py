"""FlatDDP: after backward, all gradients flattened into one buffer and all-reduced in one call.

Pays the collective's latency once instead of once per tensor, at the price of a copy in and out
of the flat buffer.
"""

from __future__ import annotations

from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddp_lab.distributed import all_reduce_mean_
from ddp_lab.strategies.base import DataParallelBase


class FlatDDP(DataParallelBase):
    def _synchronize_gradients(self) -> None:
        params = [p for p in self.trainable_parameters() if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        flat = _flatten_dense_tensors(grads)
        with self.comm.timed(flat.numel() * flat.element_size()):
            all_reduce_mean_(flat)
        for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)
