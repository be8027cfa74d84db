"""FlatDDP: after backward, all gradients flattened into one buffer and all-reduced in one call.

Pays the collective's latency once instead of once per tensor, at the price of a copy in and out
of the flat buffer.
"""

from __future__ import annotations

from ddp_lab.strategies.base import DataParallelBase
from ddp_lab.strategies.collectives import flat_all_reduce_mean_


class FlatDDP(DataParallelBase):
    def _synchronize_gradients(self) -> None:
        flat_all_reduce_mean_([p.grad for p in self.trainable_parameters() if p.grad is not None], self.comm,
                              self.wire_dtype, group=self.process_group)
