"""The zero1 and zero1_torch strategies: gradient sync plus an optimizer sharded over ranks.

`strategy=zero1` (conf/strategy/zero1.yaml) is `Zero1Strategy`: a gradient-sync wrapper chosen by
`strategy.grad_sync` (default bucketed) and `ShardedOptimizer`. `strategy.comm` picks the
communication (bytes in sharded_optimizer.py):

- `allreduce_broadcast`: the grad_sync wrapper all-reduces gradients as it would without
  sharding; after the step each owner broadcasts its updated parameters.
- `reduce_scatter`: ZeRO-1 proper. No all-reduce: `ShardedGradSync`, the wrapper, hands each
  owner the average of its parameters' gradients in `finish_gradient_synchronization()`, and the
  step ends with an all-gather of the updated parameters. `grad_sync` and `bucket_mb` are unused.
  After the sync only owned parameters keep a `.grad` (averaged); a global gradient norm would
  need a sum over ranks.

`strategy=zero1_torch` (conf/strategy/zero1_torch.yaml): torch's DistributedDataParallel with
torch's ZeroRedundancyOptimizer, the in-run reference. Its post-step parameter broadcasts are
recorded in the wrapper's comm figures as ShardedOptimizer's are, so both columns count the same.

Grad-sync wrappers are looked up by name in `ddp_lab.strategies` when a run starts, so wrappers
added there later (bucketed, overlap, torch_ddp) need no change here.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from ddp_lab.strategies.base import DataParallelBase
from ddp_lab.strategies.sharded_optimizer import REDUCE_SCATTER, ShardedOptimizer
from ddp_lab.strategies.strategy import Strategy

GRAD_SYNC = {"naive": "NaiveDDP", "flat": "FlatDDP", "overlap": "OverlapDDP", "bucketed": "BucketedDDP",
             "torch_ddp": "TorchDDP"}


def grad_sync_wrapper(name: str):
    """The wrapper class for a `strategy.grad_sync` name, imported only when asked for."""
    import ddp_lab.strategies as strategies

    if name not in GRAD_SYNC:
        raise ValueError(f"unknown strategy.grad_sync {name!r}; options: {', '.join(GRAD_SYNC)}")
    cls = getattr(strategies, GRAD_SYNC[name], None)
    if cls is None:
        raise ValueError(f"strategy.grad_sync={name}: ddp_lab.strategies has no {GRAD_SYNC[name]} yet")
    return cls


def zero1_wrapper(module: nn.Module, grad_sync: str = "bucketed", bucket_mb: float | None = 25.0,
                  comm: str = "allreduce_broadcast") -> nn.Module:
    """The gradient side of zero1: `grad_sync`'s wrapper, or ShardedGradSync for reduce_scatter."""
    if comm == REDUCE_SCATTER:
        return ShardedGradSync(module)
    cls = grad_sync_wrapper(grad_sync)
    if bucket_mb is not None and "bucket_mb" in inspect.signature(cls).parameters:
        return cls(module, bucket_mb=bucket_mb)
    return cls(module)


class ShardedGradSync(DataParallelBase):
    """ZeRO-1's gradient sync: a reduce-scatter by the attached ShardedOptimizer, no all-reduce.

    Backward communicates nothing (so `no_sync()` changes nothing); the reduce-scatter runs in
    `finish_gradient_synchronization()` so it is timed where every other strategy's sync is. If
    no optimizer is attached, `ShardedOptimizer.step()` does it instead.
    """

    optimizer: ShardedOptimizer | None = None

    def _synchronize_gradients(self) -> None:
        if self.optimizer is not None:
            self.optimizer.reduce_scatter_gradients()


class Zero1Strategy(Strategy):
    """`Strategy` plus one link: the optimizer it builds reports to the wrapper it made.

    The trainer reads communication figures from the wrapper's `comm`; the sharded optimizer's
    broadcasts/all-gathers (ShardedOptimizer's or torch's) are recorded there too, and in
    reduce_scatter mode the wrapper calls the optimizer's reduce-scatter.
    """

    _wrapped: nn.Module | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        self._wrapped = super().wrap(model)
        return self._wrapped

    def build_optimizer(self, params, optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
        optimizer = super().build_optimizer(params, optimizer_cls, **kwargs)
        if hasattr(optimizer, "comm_stats") and self._wrapped is not None:
            optimizer.comm_stats = getattr(self._wrapped, "comm", None)
            if isinstance(self._wrapped, ShardedGradSync) and isinstance(optimizer, ShardedOptimizer):
                self._wrapped.optimizer = optimizer
        return optimizer


class TimedZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
    """torch's ZeroRedundancyOptimizer, its parameter broadcasts timed like ShardedOptimizer's.

    Hooks two private methods that torch 2.4-2.13 all have: `_sync_params` (a step's
    broadcasts, issued async and waited for) and `_broadcast_params_from_rank` (one rank's
    handles, counted). Without `comm_stats` it is torch's class unchanged.
    """

    comm_stats = None  # set by Zero1Strategy to the wrapper's CommStats
    _handles_issued = 0

    def _broadcast_params_from_rank(self, rank: int):
        handles = super()._broadcast_params_from_rank(rank)
        self._handles_issued += len(handles)
        return handles

    def _sync_params(self):
        if self.comm_stats is None:
            return super()._sync_params()
        self._handles_issued = 0
        nbytes = sum(p.numel() * p.element_size() for g in self.param_groups for p in g["params"])
        with self.comm_stats.exposed(in_optimizer=True), self.comm_stats.timed(nbytes):
            super()._sync_params()
        self.comm_stats.collectives += self._handles_issued - 1


def torch_zero_optimizer(params, optimizer_cls: type[torch.optim.Optimizer], **kwargs):
    """torch's ZeroRedundancyOptimizer with the `optimizer(params, optimizer_cls, **kwargs)` shape."""
    return TimedZeroRedundancyOptimizer(params, optimizer_class=optimizer_cls, **kwargs)
