"""`strategy=zero2`: ZeRO stage 2, gradients and optimizer state sharded over ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ddp_lab.arithmetic.buckets import DEFAULT_BUCKET_MB
from ddp_lab.spec.choices import Dtype
from ddp_lab.spec.schedule import GradientSync, ParameterSync, Schedule
from ddp_lab.spec.strategy import StrategySpec, knob_at_least


@dataclass
class Zero2Spec(StrategySpec):
    """ZeRO stage 2: buckets of at most bucket_mb MiB (bucketed's plan) reduce-scattered during backward as
    they fill; each rank keeps its slice of the averaged gradient, updates its slice of the parameters,
    and the updated slices are all-gathered (on gloo the lab's rings, backend.collectives)."""

    _target_: str = "ddp_lab.spec.strategies.zero2.Zero2Spec"
    name: str = "zero2"
    bucket_mb: float = DEFAULT_BUCKET_MB
    """Bucket cap in MiB; zero2 keeps at most 2 x bucket_mb of freed buckets for the next step."""
    comm_dtype: Optional[Dtype] = None
    """Dtype of gradients on the wire (unset: fp32); the average lands in the fp32 gradient shard."""

    runtime = "ddp_lab.strategies.Zero2"
    mesh_refusal = None
    expert_refusal = ("it reduce-scatters every gradient over the one data-parallel group, and an expert's copies "
                      "live on its own (edp) group, to be sharded there")
    torch_reference = "zero1_torch"
    zero_stage = 2
    whole_parameter_optimizer = False  # its optimizer updates flat slices: no Muon

    def check(self) -> None:
        knob_at_least(self, "bucket_mb", 0, strictly=True)

    def schedule(self) -> Schedule:
        return Schedule(GradientSync("bucket", "ready", op="reduce_scatter", bucket_mb=self.bucket_mb,
                                     grads_in_buckets=True),
                        update="shard", parameters=ParameterSync("all_gather", "bucket"))
