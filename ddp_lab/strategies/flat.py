"""FlatDDP: after backward, all gradients flattened into one buffer and all-reduced in one call.

Pays the collective's latency once instead of once per tensor, at the price of a copy in and out
of the flat buffer. One flat buffer per class of the replica map (strategies/replicas.py): experts are averaged
over another group than the dense weights.
"""

from __future__ import annotations

from ddp_lab.strategies.base import DataParallelBase
from ddp_lab.strategies.collectives import flat_all_reduce_mean_


class FlatDDP(DataParallelBase):
    def _synchronize_gradients(self) -> None:
        for replica, params in self.replicas.split(self.trainable_parameters()):
            flat_all_reduce_mean_([p.grad for p in params if p.grad is not None], self.comm, self.wire_dtype,
                                  group=replica.group, divisor=replica.divisor)
