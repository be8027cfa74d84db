"""`strategy=overlap`: one async all-reduce per gradient tensor, launched as soon as it is ready."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ddp_lab.spec.choices import Dtype
from ddp_lab.spec.schedule import GradientSync, Schedule
from ddp_lab.spec.strategy import StrategySpec


@dataclass
class OverlapSpec(StrategySpec):
    """One async all-reduce per parameter, launched from its post-accumulate-grad hook during backward."""

    _target_: str = "ddp_lab.spec.strategies.overlap.OverlapSpec"
    name: str = "overlap"
    comm_dtype: Optional[Dtype] = None
    """Dtype of gradients on the wire (unset: fp32); the average lands in the fp32 gradient."""

    runtime = "ddp_lab.strategies.OverlapDDP"
    mesh_refusal = None
    expert_refusal = None
    torch_reference = "torch_ddp"

    def schedule(self) -> Schedule:
        return Schedule(GradientSync("tensor", "ready"))
