"""`strategy=local_sgd`: no gradient communication; parameters averaged every sync_every steps."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from ddp_lab.spec.choices import OuterOptimizer
from ddp_lab.spec.schedule import ParameterSync, Schedule
from ddp_lab.spec.strategy import StrategySpec, knob_at_least, require


@dataclass
class DiLoCoSpec(StrategySpec):
    """The knobs local_sgd and torchft's DiLoCo (local_sgd_torchft) share, and their checks."""

    sync_every: int = 4
    """Average the parameters every sync_every optimizer steps."""
    outer: OuterOptimizer = OuterOptimizer.none
    """The outer optimizer applied to the averaged change at each sync."""
    fragments: int = 1
    """Streaming DiLoCo: the parameters in this many fragments, each synchronized on its own step of the round
    (1: the whole model at once)."""
    delay: int = 0
    """Steps a fragment's all-reduce is launched before its sync step, travelling behind them (0: at the sync)."""
    mix: float = 0.0
    """With a delay, the weight of this rank's own fragment when the outer step lands (0: the global one replaces
    it)."""

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
        """sync_every and outer always; the others where they are not their defaults."""
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


@dataclass
class LocalSGDSpec(DiLoCoSpec):
    """Local SGD: no gradient communication; each rank steps on its own gradients and the parameters (and
    running-statistics buffers) are averaged every sync_every optimizer steps, one all-reduce.
    outer=nesterov: DiLoCo's outer step on the averaged change (SGD, Nesterov momentum 0.9, lr 0.7);
    outer=none: plain averaging. Streaming DiLoCo's fragments and delayed outer step; SparseLoCo's compressed
    pseudo-gradient (outer_topk)."""

    _target_: str = "ddp_lab.spec.strategies.local_sgd.LocalSGDSpec"
    name: str = "local_sgd"
    outer_topk: Optional[int] = None
    """SparseLoCo: send only the outer_topk largest values of each block of the pseudo-gradient (with error feedback)
    instead of all-reducing the parameters; unset: no compression."""
    outer_chunk: int = 64
    """SparseLoCo's block side (a matrix in outer_chunk x outer_chunk blocks, a vector in runs of it)."""
    outer_bits: int = 2
    """SparseLoCo's value width: 2 (four levels times a per-block scale) or 32 (unquantized)."""
    error_decay: float = 0.95
    """SparseLoCo's error feedback: e ← error_decay · e + Δ at each sync."""

    runtime = "ddp_lab.strategies.LocalSGD"
    mesh_refusal = None
    expert_refusal = ("it averages every parameter over one group at each sync, and an expert's copies live on "
                      "another")

    def check(self) -> None:
        super().check()
        # SparseLoCo's knobs are checked whether or not outer_topk turns it on: a value out of range is a mistake
        knob_at_least(self, "outer_chunk", 1)
        require(self.outer_chunk <= 181, f"strategy.outer_chunk must be <= 181 (indices travel as int16), got "
                f"{self.outer_chunk}")
        require(self.outer_bits in (2, 32), f"strategy.outer_bits must be 2 or 32, got {self.outer_bits}")
        require(0 <= self.error_decay < 1, f"strategy.error_decay must be in [0, 1), got {self.error_decay}")
        if self.outer_topk is None:
            return
        require(self.outer == "none", "strategy.outer_topk (SparseLoCo) takes strategy.outer=none: its error feedback "
                "takes the outer momentum's place")
        require(1 <= self.outer_topk <= self.outer_chunk ** 2, f"strategy.outer_topk={self.outer_topk} must be in "
                f"[1, outer_chunk² = {self.outer_chunk ** 2}]: a block has outer_chunk x outer_chunk values")

    def used_knobs(self) -> dict:
        """As DiLoCo's; SparseLoCo's block, width and decay whenever it compresses."""
        sparse = ("outer_chunk", "outer_bits", "error_decay") if self.outer_topk is not None else ()
        return {**super().used_knobs(), **{k: getattr(self, k) for k in sparse}}

    def check_model(self, module) -> None:
        super().check_model(module)
        persistent = [n for n, b in module.named_buffers() if b.is_floating_point() and n in module.state_dict()]
        require(self.outer_topk is None or not persistent, f"strategy.outer_topk: the model has running statistics "
                f"({', '.join(persistent)}), which SparseLoCo's sparse pseudo-gradient does not carry")
