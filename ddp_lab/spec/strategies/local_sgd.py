"""`strategy=local_sgd`: no gradient communication; parameters averaged every sync_every steps."""

from __future__ import annotations

from dataclasses import dataclass

from ddp_lab.spec.choices import OuterOptimizer
from ddp_lab.spec.schedule import ParameterSync, Schedule
from ddp_lab.spec.strategy import StrategySpec, knob_at_least


@dataclass
class LocalSGDSpec(StrategySpec):
    """Local SGD: no gradient communication; each rank steps on its own gradients and the parameters (and
    running-statistics buffers) are averaged every sync_every optimizer steps, one all-reduce.
    outer=nesterov: DiLoCo's outer step on the averaged change (SGD, Nesterov momentum 0.9, lr 0.7);
    outer=none: plain averaging."""

    _target_: str = "ddp_lab.spec.strategies.local_sgd.LocalSGDSpec"
    name: str = "local_sgd"
    sync_every: int = 4
    """Average the parameters every sync_every optimizer steps."""
    outer: OuterOptimizer = OuterOptimizer.none
    """The outer optimizer applied to the averaged change at each sync."""

    runtime = "ddp_lab.strategies.LocalSGD"
    reduces_gradients = False

    def check(self) -> None:
        knob_at_least(self, "sync_every", 1)

    def schedule(self) -> Schedule:
        return Schedule(parameters=ParameterSync("all_reduce", "all", every=self.sync_every))
