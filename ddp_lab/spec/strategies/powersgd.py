"""`strategy=powersgd`: PowerSGD (Vogels et al. 2019), gradient matrices sent as low-rank factors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ddp_lab.arithmetic.buckets import DEFAULT_BUCKET_MB
from ddp_lab.spec.choices import Dtype
from ddp_lab.spec.schedule import GradientSync, LowRank, Schedule
from ddp_lab.spec.strategy import StrategySpec, knob_at_least


@dataclass
class PowerSGDSpec(StrategySpec):
    """PowerSGD (Vogels et al. 2019): each gradient matrix sent as rank-`rank` factors P and Q (one
    power-iteration step, warm-started from last step's Q), with error feedback; 1-D tensors and matrices
    the factors would not shrink go exactly. Bucketed's buckets and overlap with backward."""

    _target_: str = "ddp_lab.spec.strategies.powersgd.PowerSGDSpec"
    name: str = "powersgd"
    bucket_mb: float = DEFAULT_BUCKET_MB
    """Bucket cap in MiB, as bucketed's."""
    comm_dtype: Optional[Dtype] = None
    """Dtype of P, Q and the plain tensors on the wire (unset: fp32)."""
    rank: int = 1
    """Rank of the low-rank approximation of each gradient matrix."""
    start_iter: int = 10
    """Plain all-reduces for the first start_iter synchronizations, as torch's hook defers compression (its
    docs suggest ~10% of training, at least the warm-up): the first steps' gradients change fast and the
    warm-started Q has nothing to refine yet; 10 is 10% of a 100-step benchmark run and more than
    train.warmup_steps' default 3."""

    runtime = "ddp_lab.strategies.PowerSGD"
    mesh_refusal = None
    expert_refusal = ("its low-rank compression averages every bucket over one group, and an expert's copies live "
                      "on another")

    def check(self) -> None:
        knob_at_least(self, "bucket_mb", 0, strictly=True)
        knob_at_least(self, "rank", 1)
        knob_at_least(self, "start_iter", 0)

    def schedule(self) -> Schedule:
        return Schedule(GradientSync("bucket", "ready", bucket_mb=self.bucket_mb, grads_in_buckets=True),
                        low_rank=LowRank(self.rank, self.start_iter))
