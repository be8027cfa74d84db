"""`strategy=flat`: every gradient flattened into one buffer, one all-reduce after backward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ddp_lab.spec.choices import Dtype
from ddp_lab.spec.schedule import GradientSync, Schedule
from ddp_lab.spec.strategy import StrategySpec


@dataclass
class FlatSpec(StrategySpec):
    """All gradients flattened into one buffer, one all-reduce after backward, copied back."""

    _target_: str = "ddp_lab.spec.strategies.flat.FlatSpec"
    name: str = "flat"
    comm_dtype: Optional[Dtype] = None
    """Dtype of gradients on the wire (unset: fp32); the average lands in the fp32 gradient."""

    runtime = "ddp_lab.strategies.FlatDDP"
    mesh_refusal = None
    expert_refusal = None
    torch_reference = "torch_ddp"

    def schedule(self) -> Schedule:
        return Schedule(GradientSync("all", "after_backward", host_copies=True))
