"""`strategy=demo`: DeMo (decoupled momentum): the top DCT coefficients of each rank's momentum, all-gathered."""

from __future__ import annotations

from dataclasses import dataclass

from ddp_lab.spec.strategy import StrategySpec, knob_at_least, require


@dataclass
class DeMoSpec(StrategySpec):
    """DeMo (Peng, Quesnelle, Kingma 2024): no gradient all-reduce; each rank keeps a momentum of its own
    gradients, sends the topk largest DCT coefficients of each chunk x chunk block of it (one all-gather),
    keeps the rest, and every rank steps sign-SGD on the decoded mean. Its own optimizer (SGD on the sign)."""

    _target_: str = "ddp_lab.spec.strategies.demo.DeMoSpec"
    name: str = "demo"
    topk: int = 32
    """DCT coefficients sent per block (the authors' compression_topk)."""
    chunk: int = 64
    """Block side: matrices in chunk x chunk blocks, vectors in runs of chunk (compression_chunk); each side
    is the largest divisor of the dimension not above it."""
    decay: float = 0.999
    """The momentum's decay per step (compression_decay)."""

    runtime = "ddp_lab.strategies.DeMo"
    mesh_refusal = None
    expert_refusal = ("it exchanges every parameter's components over one group, and an expert's copies live on "
                      "another")
    reduces_gradients = False  # it gathers coefficients of a momentum: no gradient collective, no comm_dtype
    whole_parameter_optimizer = False  # DeMo is its own optimizer (sign-SGD): no train.optimizer=muon

    def check(self) -> None:
        knob_at_least(self, "chunk", 1)
        require(self.chunk <= 181, f"strategy.chunk must be <= 181 (a block's indices travel as int16), got "
                f"{self.chunk}")
        require(1 <= self.topk <= self.chunk * self.chunk, f"strategy.topk={self.topk} must be in [1, chunk² = "
                f"{self.chunk * self.chunk}]: a block has chunk x chunk coefficients")
        require(0 <= self.decay < 1, f"strategy.decay must be in [0, 1), got {self.decay}")

    def check_run(self, precision: str, grad_accum_steps: int) -> None:
        require(precision != "fp16", "strategy=demo takes train.precision fp32 or bf16: fp16's scaled (and "
                "sometimes infinite) gradients would stay in its momentum")
