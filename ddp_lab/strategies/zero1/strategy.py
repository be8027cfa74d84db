"""`strategy=zero1`: a gradient-sync wrapper plus ShardedOptimizer, wired to each other.

`strategy.grad_sync` (default bucketed) names the wrapper that averages gradients, one of the
gradient-sync strategies; `strategy.comm` picks the communication (bytes in optimizer.py):

- `allreduce_broadcast`: the grad_sync wrapper all-reduces gradients as it would without
  sharding; after the step each owner broadcasts its updated parameters.
- `reduce_scatter`: ZeRO-1 proper. No all-reduce: `ShardedGradSync` hands each owner the average
  of its parameters' gradients in `finish_gradient_synchronization()`, and the step ends with an
  all-gather of the updated parameters. `grad_sync` and `bucket_mb` are unused. After the sync
  only owned parameters keep a `.grad` (averaged); a global gradient norm would need a sum over
  ranks.

The wrapper and its optimizer report to one `CommStats`, so the optimizer's broadcasts and
all-gathers show up in the step's comm figures with the gradient sync's.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from torch import nn

from ddp_lab.config import GradSync, ZeroComm
from ddp_lab.spec.buckets import DEFAULT_BUCKET_MB
from ddp_lab.strategies.base import DataParallelBase
from ddp_lab.strategies.bucketed import BucketedDDP
from ddp_lab.strategies.flat import FlatDDP
from ddp_lab.strategies.naive import NaiveDDP
from ddp_lab.strategies.overlap import OverlapDDP
from ddp_lab.strategies.torch_ddp import TorchDDP
from ddp_lab.strategies.zero1.optimizer import ShardedOptimizer

# The strategies `strategy.grad_sync` may name (its options are the GradSync enum of the schema).
GRAD_SYNC = {cls.name: cls for cls in (NaiveDDP, FlatDDP, OverlapDDP, BucketedDDP, TorchDDP)}
assert set(GRAD_SYNC) == {g.value for g in GradSync}


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


class Zero1(nn.Module):
    """ZeRO stage 1 behind the strategy contract: `.sync` averages gradients, the optimizer shards."""

    name = "zero1"
    zero_stage = 1

    def __init__(self, module: nn.Module, grad_sync: str = GradSync.bucketed, bucket_mb: float = DEFAULT_BUCKET_MB,
                 comm: str = ZeroComm.allreduce_broadcast, comm_dtype: str = "fp32"):
        super().__init__()
        self.comm_mode = ZeroComm(comm)
        if self.comm_mode == ZeroComm.reduce_scatter:
            self.sync = ShardedGradSync(module, comm_dtype)
        else:
            cls = GRAD_SYNC[GradSync(grad_sync).value]
            takes_buckets = "bucket_mb" in inspect.signature(cls).parameters
            knobs = {"bucket_mb": bucket_mb} if takes_buckets else {}
            self.sync = cls(module, comm_dtype=comm_dtype, **knobs)

    @staticmethod
    def sync_class(knobs) -> type:
        """The class that reduces the gradients for these knobs (for checks before launch)."""
        if str(knobs.get("comm") or ZeroComm.allreduce_broadcast) == ZeroComm.reduce_scatter:
            return ShardedGradSync
        return GRAD_SYNC[str(knobs.get("grad_sync") or GradSync.bucketed)]

    @property
    def module(self) -> nn.Module:
        return self.sync.module

    @property
    def comm(self):
        return self.sync.comm

    def forward(self, *args, **kwargs):
        return self.sync(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        with self.sync.no_sync():
            yield

    def finish_gradient_synchronization(self) -> None:
        self.sync.finish_gradient_synchronization()

    def facts(self) -> dict:
        return self.sync.facts()

    def kept_tensors(self) -> list[torch.Tensor]:
        return self.sync.kept_tensors()

    def full_state_dict(self) -> dict:
        return self.sync.full_state_dict()

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], params=None, **kwargs) -> ShardedOptimizer:
        params = self.sync.trainable_parameters() if params is None else params
        optimizer = ShardedOptimizer(params, optimizer_cls, comm=self.comm_mode, comm_stats=self.comm,
                                     grad_dtype=self.sync.wire_dtype, **kwargs)
        if isinstance(self.sync, ShardedGradSync):
            self.sync.optimizer = optimizer
        return optimizer
