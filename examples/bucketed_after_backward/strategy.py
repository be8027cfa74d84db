"""`BucketedAfterBackward`: a strategy written outside ddp_lab, kept to the contract of
ddp_lab/strategies/base.py by subclassing `DataParallelBase`.

After backward, each bucket of gradients (bucketed's plan at `bucket_mb`) is flattened into a buffer of
its own and all-reduced, every bucket's all-reduce in flight at once; then each average is copied back
into the gradients. A parameter that got no gradient on this step sends zeros and ends with the average
(zeros where no rank used it), so every rank issues the same collectives.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddp_lab.arithmetic.buckets import DEFAULT_BUCKET_MB
from ddp_lab.strategies import DataParallelBase, plan_buckets
from ddp_lab.strategies.collectives import all_reduce_mean_async
from ddp_lab.strategies.comm_stats import record_intervals


class BucketedAfterBackward(DataParallelBase):
    def __init__(self, module: nn.Module, bucket_mb: float = DEFAULT_BUCKET_MB, comm_dtype: str = "fp32"):
        super().__init__(module, comm_dtype)
        trainable = self.trainable_parameters()
        self.buckets = [[trainable[i] for i in bucket] for bucket in plan_buckets(trainable, bucket_mb)]

    def facts(self) -> dict:
        return {"buckets": len(self.buckets)}

    def _synchronize_gradients(self) -> None:
        """Called inside `comm.exposed()` (the base class): all of it is exposed, by design."""
        launched = []
        for bucket in self.buckets:
            flat = _flatten_dense_tensors([p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket])
            launched.append((bucket, flat, *all_reduce_mean_async(flat, self.wire_dtype)))
        for bucket, flat, future, _ in launched:
            future.wait()
            for param, average in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                if param.grad is None:
                    param.grad = average.clone()
                else:
                    param.grad.copy_(average)
        record_intervals([stamp for *_, stamp in launched], self.comm)
