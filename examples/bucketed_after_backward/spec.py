"""The spec of `strategy=bucketed_after_backward`: what every process knows of it without running it.

Torch-free, like the specs in ddp_lab/spec/strategies/: the launcher checks the knobs with it before any
rank starts, the ranks build the runtime class it names, and `python -m ddp_lab.predict` replays its
schedule. The YAML beside it (examples/conf/strategy/bucketed_after_backward.yaml) names this class in
`_target_`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ddp_lab.arithmetic.buckets import DEFAULT_BUCKET_MB
from ddp_lab.spec.choices import Dtype
from ddp_lab.spec.schedule import GradientSync, Schedule
from ddp_lab.spec.strategy import StrategySpec, knob_at_least


@dataclass
class BucketedAfterBackwardSpec(StrategySpec):
    """bucketed's buckets, each all-reduced after backward instead of during it: the same bytes and the
    same number of collectives as bucketed at the same bucket_mb, with no overlap. Beside bucketed in
    one sweep it shows what overlapping communication with backward buys."""

    _target_: str = "examples.bucketed_after_backward.spec.BucketedAfterBackwardSpec"
    name: str = "bucketed_after_backward"
    bucket_mb: float = DEFAULT_BUCKET_MB
    """Bucket cap in MiB, as bucketed's (the same plan: reverse parameter order)."""
    comm_dtype: Optional[Dtype] = None
    """Dtype of gradients on the wire (unset: fp32); the average lands in the fp32 gradient."""

    runtime = "examples.bucketed_after_backward.strategy.BucketedAfterBackward"

    def check(self) -> None:
        knob_at_least(self, "bucket_mb", 0, strictly=True)

    def schedule(self) -> Schedule:
        return Schedule(GradientSync("bucket", "after_backward", bucket_mb=self.bucket_mb, host_copies=True))
