"""`strategy=local_sgd`: no gradient communication; parameters averaged every sync_every steps."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ddp_lab.spec.choices import OuterOptimizer
from ddp_lab.spec.schedule import ParameterSync, Schedule
from ddp_lab.spec.strategy import StrategySpec, knob_at_least, require


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
    fragments: int = 1
    """Streaming DiLoCo: the parameters in this many fragments, each synchronized on its own step of the round
    (1: the whole model at once)."""
    delay: int = 0
    """Inner steps each fragment's all-reduce travels behind before its outer step lands (0: at once; < sync_every)."""
    mix: float = 0.0
    """With a delay, the weight of this rank's own fragment when the outer step lands (0: the global one replaces
    it)."""

    runtime = "ddp_lab.strategies.LocalSGD"
    reduces_gradients = False

    def check(self) -> None:
        knob_at_least(self, "sync_every", 1)
        knob_at_least(self, "fragments", 1)
        require(self.fragments <= self.sync_every, f"strategy.fragments={self.fragments} must be <= "
                f"strategy.sync_every={self.sync_every}: each fragment syncs on its own step of the round")
        require(0 <= self.delay < self.sync_every, f"strategy.delay={self.delay} must be in [0, strategy.sync_every="
                f"{self.sync_every}): a fragment's outer step must land before its next sync")
        require(0 <= self.mix < 1, f"strategy.mix must be in [0, 1), got {self.mix}")
        require(self.mix == 0 or self.delay > 0, f"strategy.mix={self.mix} needs strategy.delay > 0: without a delay "
                "the local and the global fragment are the same step's")

    def used_knobs(self) -> dict:
        """sync_every and outer always; fragments, delay and mix where they are not today's local SGD."""
        defaults = {f.name: f.default for f in fields(self)}
        return {k: v for k, v in self.knobs().items() if k in ("sync_every", "outer") or v != defaults[k]}

    def check_checkpoints(self) -> None:
        require(self.delay == 0, f"strategy.delay={self.delay}: a checkpoint would miss the all-reduces in flight; "
                "use strategy.delay=0 with checkpoint.every")

    def check_model(self, module) -> None:
        tensors = sum(1 for p in module.parameters() if p.requires_grad)
        require(self.fragments <= tensors, f"strategy.fragments={self.fragments} is more than the model's "
                f"{tensors} trainable parameter tensors: each fragment needs one")

    def schedule(self) -> Schedule:
        return Schedule(parameters=ParameterSync("all_reduce", "all", every=self.sync_every))
