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

from contextlib import contextmanager

import torch
from torch import nn

from ddp_lab.arithmetic.buckets import DEFAULT_BUCKET_MB
from ddp_lab.spec.choices import ZeroComm
from ddp_lab.spec.strategies.zero1 import GradSync, Zero1Spec
from ddp_lab.strategies.base import DataParallelBase
from ddp_lab.strategies.zero1.optimizer import ShardedOptimizer


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


class Zero1(DataParallelBase):
    """ZeRO stage 1 behind the strategy contract: `.sync` averages gradients, the optimizer shards.

    `.sync` is the grad_sync strategy its spec names (built by that strategy's own spec), or
    ShardedGradSync with comm=reduce_scatter; it broadcast the model, and its CommStats is this one's.
    """

    def __init__(self, module: nn.Module, grad_sync: str = GradSync.bucketed, bucket_mb: float = DEFAULT_BUCKET_MB,
                 comm: str = ZeroComm.allreduce_broadcast, comm_dtype: str = "fp32", process_group=None):
        super().__init__(module, comm_dtype, broadcast=False, process_group=process_group)
        self.comm_mode = ZeroComm(comm)
        sync = Zero1Spec(bucket_mb=bucket_mb, grad_sync=GradSync(grad_sync), comm=self.comm_mode,
                         comm_dtype=comm_dtype).grad_sync_spec()
        group = {} if process_group is None else {"process_group": process_group}
        self.sync = ShardedGradSync(module, comm_dtype, **group) if sync is None else sync.build(module, **group)
        self.comm = self.sync.comm

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
                                     grad_dtype=self.sync.wire_dtype, process_group=self.process_group, **kwargs)
        if isinstance(self.sync, ShardedGradSync):
            self.sync.optimizer = optimizer
        return optimizer
