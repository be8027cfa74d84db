"""`strategy=replicate_torch`: torch's `replicate()` (DDP rebuilt on FSDP2), beside torch_ddp the bar for bucketed.

torch 2.13's composable `replicate` (torch/distributed/_composable/replicate_with_fsdp.py) runs DDP
on FSDP2's machinery: parameters become replicated DTensors, and each replicated module's gradients
are all-reduced when its backward is done. It is applied as fsdp_torch applies `fully_shard`: to each
of fsdp's units (every Transformer block, the embedding, the output head), then to the whole model,
so gradients leave in one all-reduce per unit during backward (the units are its buckets); a model
with no unit is one all-reduce after backward.

Communication is counted from what it issues: FSDP2 calls `dist.all_reduce` from its collectives
module, whose `dist` is wrapped (once per process) to add each call's bytes and interval; the call
blocks the host on CPU (a wait: exposed, `CommStats.waited`), on CUDA it runs on FSDP2's all-reduce
stream and the interval is the host's launch only (the figures say so: `comm_figures`).
"""

from __future__ import annotations

import time
import weakref

import torch
from torch import nn

from ddp_lab.spec.strategies.fsdp_units import unit_modules
from ddp_lab.strategies.comm_stats import Stamp
from ddp_lab.strategies.fsdp_torch import FSDP2Strategy
from ddp_lab.units import tensor_bytes


class _CountingDist:
    """torch.distributed as FSDP2's collectives module sees it, with all_reduce recorded for the strategy
    that asked last."""

    def __init__(self, dist):
        self._dist, self.strategy = dist, lambda: None

    def __getattr__(self, name):
        return getattr(self._dist, name)

    def all_reduce(self, tensor, *args, **kwargs):
        strategy = self.strategy()  # a weak reference: a strategy that is gone is not kept alive here
        if strategy is None:
            return self._dist.all_reduce(tensor, *args, **kwargs)
        stamp = Stamp(tensor_bytes(tensor))
        stamp.start = time.perf_counter()
        with strategy.comm.waited():
            work = self._dist.all_reduce(tensor, *args, **kwargs)
        stamp.end = time.perf_counter()
        strategy.stamps.append(stamp)
        return work


def _count_all_reduce(strategy) -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    if not isinstance(collectives.dist, _CountingDist):
        collectives.dist = _CountingDist(collectives.dist)
    collectives.dist.strategy = weakref.ref(strategy)


class TorchReplicate(FSDP2Strategy):
    """torch's replicate() behind the strategy contract (module docstring)."""

    def __init__(self, module: nn.Module, process_group=None):
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.device_mesh import DeviceMesh

        # replicate() keeps each rank's own weights: start from the first rank's
        super().__init__(module, process_group=process_group)
        device = next(module.parameters()).device
        mesh = (None if process_group is None else  # a mesh's data-parallel axis
                DeviceMesh.from_group(process_group, device.type, mesh_dim_names=("replicate",)))
        units = unit_modules(module)  # none: the whole model is one unit
        for unit in units:
            replicate(unit, mesh=mesh)
        replicate(module, mesh=mesh)
        self._units, self.stamps = units, []
        _count_all_reduce(self)

    def facts(self) -> dict:
        return {"replicate_torch": {"units": len(self._units) + 1,
                                    "comm_figures": "measured" if not torch.cuda.is_available() else "launch only"}}
