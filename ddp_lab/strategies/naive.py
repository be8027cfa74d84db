"""NaiveDDP: after backward, one blocking all-reduce per gradient tensor.

The baseline: simple and correct, and slow on models with many tensors because every call pays the
collective's fixed latency.
"""

from __future__ import annotations

from ddp_lab.strategies.base import DataParallelBase
from ddp_lab.strategies.collectives import all_reduce_mean_, wire_bytes


class NaiveDDP(DataParallelBase):
    def _synchronize_gradients(self) -> None:
        for param in self.trainable_parameters():
            if param.grad is None:
                # A parameter unused this step: every rank agrees (same model, same graph), so
                # skipping keeps ranks in step; its optimizer update is skipped everywhere.
                continue
            replica = self.replicas.of(param)  # its copies' group and divisor (strategies/replicas.py)
            with self.comm.timed(wire_bytes(param.grad, self.wire_dtype)):
                all_reduce_mean_(param.grad, group=replica.group, dtype=self.wire_dtype, divisor=replica.divisor)
