"""NoSync (`strategy=none`): the floor. The model as it is, no broadcast, no hook, no collective.

What a step costs with nothing of a strategy's in it: the same trainer, the same timers, the same model
and optimizer. At world_size 1 it is the plain single-process loop; at more ranks each rank trains alone on
its slice of the batch (the ranks' weights drift apart, and `facts()` says so in the summary).
"""

from __future__ import annotations

from torch import nn

from ddp_lab.strategies.base import DataParallelBase


class NoSync(DataParallelBase):
    def __init__(self, module: nn.Module, comm_dtype: str = "fp32", process_group=None, replicas=None):
        super().__init__(module, comm_dtype, broadcast=False, process_group=process_group, replicas=replicas)

    def _synchronize_gradients(self) -> None:
        """Nothing to wait for: no rank hears from another."""

    def facts(self) -> dict:
        alone = self.dp_size > 1
        return {"floor": {"synchronizes": False,
                          "ranks": "each rank trains alone on its slice of the batch: no collective, the ranks' "
                                   "weights differ" if alone else "one rank: the plain single-process loop"}}
