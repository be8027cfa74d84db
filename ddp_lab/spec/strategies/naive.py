"""`strategy=naive`: one blocking all-reduce per gradient tensor, after backward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ddp_lab.spec.choices import Dtype
from ddp_lab.spec.schedule import GradientSync, Schedule
from ddp_lab.spec.strategy import StrategySpec


@dataclass
class NaiveSpec(StrategySpec):
    """One blocking all-reduce per gradient tensor, after backward: the simplest correct DDP."""

    _target_: str = "ddp_lab.spec.strategies.naive.NaiveSpec"
    name: str = "naive"
    comm_dtype: Optional[Dtype] = None
    """Dtype of gradients on the wire (unset: fp32); the average lands in the fp32 gradient."""

    runtime = "ddp_lab.strategies.NaiveDDP"
    mesh_refusal = None
    expert_refusal = None
    torch_reference = "torch_ddp"

    def schedule(self) -> Schedule:
        return Schedule(GradientSync("tensor", "after_backward", blocking=True))
