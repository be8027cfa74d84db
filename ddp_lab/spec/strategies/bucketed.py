"""`strategy=bucketed`: gradients in buckets, one async all-reduce per bucket as soon as it is full."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ddp_lab.spec.buckets import DEFAULT_BUCKET_MB
from ddp_lab.spec.choices import Dtype
from ddp_lab.spec.schedule import GradientSync, Schedule
from ddp_lab.spec.strategy import StrategySpec, knob_at_least


@dataclass
class BucketedSpec(StrategySpec):
    """Gradients in buckets of at most bucket_mb MiB (reverse parameter order), one async all-reduce per
    bucket as soon as its last gradient is ready; gradients are views into the buckets."""

    _target_: str = "ddp_lab.spec.strategies.bucketed.BucketedSpec"
    name: str = "bucketed"
    bucket_mb: float = DEFAULT_BUCKET_MB
    """Bucket cap in MiB (2^20 bytes, as torch DDP's bucket_cap_mb); a larger tensor gets a bucket of its own."""
    comm_dtype: Optional[Dtype] = None
    """Dtype of gradients on the wire (unset: fp32); the average lands in the fp32 gradient."""

    runtime = "ddp_lab.strategies.BucketedDDP"

    def check(self) -> None:
        knob_at_least(self, "bucket_mb", 0, strictly=True)

    def schedule(self) -> Schedule:
        return Schedule(GradientSync("bucket", "ready", bucket_mb=self.bucket_mb, grads_in_buckets=True))
