"""`strategy=zero1_torch`: torch's DistributedDataParallel with torch's ZeroRedundancyOptimizer.

The in-run reference for zero1 (whole parameters, greedy by size; updated parameters are broadcast
by their owners after each step). Its post-step parameter broadcasts are recorded in the wrapper's
comm figures as ShardedOptimizer's are, so both columns count the same bytes. They run on the
collectives `backend.collectives` chooses, as FSDP2's do in fsdp_torch: on gloo the lab's chain
broadcasts of the very tensors torch would broadcast (gloo's own broadcast sends every copy from the
owner: on emulated nodes, twice the bytes over a node's link), so the reference pays what the
algorithm moves; `backend.collectives=native` keeps torch's own `dist.broadcast` calls.
"""

from __future__ import annotations

import functools

import torch

from ddp_lab.strategies.collectives import broadcasts, collectives_in_use
from ddp_lab.strategies.torch_ddp import TorchDDP
from ddp_lab.units import tensor_bytes


@functools.cache
def timed_zero_redundancy_optimizer() -> type:
    """The class below, defined on first use: importing torch.distributed.optim pulls in FSDP and
    DTensor, about a second of every rank's start whatever strategy it runs."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class TimedZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
        """torch's ZeroRedundancyOptimizer, its parameter broadcasts timed like ShardedOptimizer's.

        Hooks two private methods that torch 2.4-2.13 all have: `_sync_params` (a step's
        broadcasts, issued async and waited for) and `_broadcast_params_from_rank` (one rank's
        handles, counted). With the rings, `_sync_params` sends the tensors torch would broadcast
        (each rank's bucket per device, or each parameter it owns) through one `broadcasts` call,
        as ShardedOptimizer does. Without `comm_stats` and with `collectives="native"` it is
        torch's class unchanged.
        """

        comm_stats = None  # set by TorchZero1 to the wrapper's CommStats
        collectives = "native"  # set by TorchZero1 to what backend.collectives chose
        _handles_issued = 0

        def _broadcast_params_from_rank(self, rank: int):
            handles = super()._broadcast_params_from_rank(rank)
            self._handles_issued += len(handles)
            return handles

        def _rank_tensors(self, rank: int) -> list[torch.Tensor]:
            """What torch broadcasts from `rank`: its bucket per device, or each parameter it owns."""
            if self.parameters_as_bucket_view:
                return [buckets[rank] for buckets in self._buckets]
            return [p.data for group in self._partition_parameters()[rank] for p in group["params"]]

        def _ring_sync_params(self) -> None:
            sent = [(t, rank) for rank in range(self.world_size) for t in self._rank_tensors(rank)]
            self._handles_issued += len(sent)
            for work in broadcasts([t for t, _ in sent], [rank for _, rank in sent], group=self.process_group,
                                   implementation="ring"):
                work.wait()

        def _sync_params(self):
            sync = super()._sync_params if self.collectives == "native" else self._ring_sync_params
            if self.comm_stats is None:
                return sync()
            self._handles_issued = 0
            nbytes = sum(tensor_bytes(p) for g in self.param_groups for p in g["params"])
            with self.comm_stats.exposed(in_optimizer=True), self.comm_stats.timed(nbytes):
                sync()
            self.comm_stats.collectives += self._handles_issued - 1

    return TimedZeroRedundancyOptimizer


class TorchZero1(TorchDDP):
    """TorchDDP (`bucket_mb` as DDP's `bucket_cap_mb`) whose optimizer is torch's ZeRO-1."""

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], params=None,
                       **kwargs) -> torch.optim.Optimizer:
        params = self.trainable_parameters() if params is None else params
        optimizer = timed_zero_redundancy_optimizer()(params, optimizer_class=optimizer_cls,
                                                      process_group=self.process_group, **kwargs)
        optimizer.comm_stats = self.comm
        optimizer.collectives = collectives_in_use(optimizer.process_group)
        return optimizer
