"""How far the planner's figures land from measurement, by its own checks: the range each printed figure comes with.

A predicted step s comes with [s x low, s x high], the measured-over-predicted ratios its checks found for layouts of
that kind (tokens per second per GPU with the same range inverted):

- `this-machine`: the 234 layouts of tiny measured on this project's VM, priced as the planner prices them now, with
  this machine's calibration: the 166 of 2026-11-28 (docs/measured/plan.md: the 58 checked and the 108 held out) and
  the 68 of 2026-11-29 (the unseen check twice, FSDP2 under a pipeline); the 10th to the 90th percentile (8 in 10
  layouts fell inside). Every run here, not one day's: the same command measured up to a third apart from one run to
  the next (docs/measured/plan_unseen_rerun.md), and a range drawn from the 166 alone (0.90x to 1.31x) missed the
  best layout of the unseen check run again at 8 ranks. Recomputed on 2026-11-30 with the calibration measured
  again on the AMD VM, attention's rate and the ring's floor priced (0.93x to 1.47x before; 0.77x to 1.25x with the
  ring's wait added to each step instead, which the check at context 512 showed wrong: docs/measured/
  plan_unseen_long.md), before the check at context 384 ran. Of the 23 rows above it, 16 are the 68 of 2026-11-29
  (the Intel VM, context 128: median 1.17x); of the 23 below, 21 are the 166 of 2026-11-28 (median 1.02x);
- a GPU system: the 11 published torchtitan Llama 3.1 rows (`python -m ddp_lab.predict published`, at its calibrated
  MFU), from the least to the most; and memory, published over priced, from the least to the most (the planner
  counts what ZeRO and the activations need, not the allocator's reserve or the communication buffers).

- this machine's memory: the census's most a rank held (its model state and activations' peak) over the planner's
  printed figure (its total: what the census counts and the log-softmax's gradient, which the census cannot see), on
  the 28 layouts of the unseen check at twice the batch run again with the census and the memory pricing of
  2026-11-30 (docs/measured/plan_unseen_batch.md), 10th to 90th percentile.

tests/unit/test_plan.py recomputes every range from those rows: a change to the pricing that moves one fails there
until the figures here are made again.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddp_lab.analysis.plan.host import HostSystem
from ddp_lab.analysis.predict.systems import System


@dataclass(frozen=True)
class Range:
    low: float
    high: float
    source: str

    def of(self, predicted: float) -> tuple[float, float]:
        return predicted * self.low, predicted * self.high


STEP = {
    "this-machine": Range(0.85, 1.31, "8 in 10 of 234 layouts measured here"),
    "gpu": Range(0.83, 2.64, "11 published torchtitan runs"),
}
"""Measured step over predicted, by the kind of system (module docstring)."""

MEMORY = {"this-machine": Range(0.81, 0.97, "8 in 10 of 28 layouts' census here"),
          "gpu": Range(1.32, 1.96, "11 published torchtitan runs")}
"""Measured memory per GPU over predicted, by the kind of system."""


def kind_of(system: System) -> str:
    return "this-machine" if isinstance(system, HostSystem) else "gpu"


def step_range(system: System) -> Range:
    return STEP[kind_of(system)]


def memory_range(system: System) -> Range:
    return MEMORY[kind_of(system)]


def a_tie(system: System, pick_ms: float, runner_up_ms: float) -> bool:
    """Whether the runner-up's predicted step lies inside the pick's range: the planner cannot tell them apart."""
    return runner_up_ms <= step_range(system).of(pick_ms)[1]


def said(system: System, step_ms: float, tokens_per_s: float, memory_gb: float) -> str:
    """One line: the step, tokens per second per GPU and memory, each with its range and where that comes from."""
    step = step_range(system)
    lo, hi = step.of(step_ms)
    text = (f"step {step_ms:,.1f} ms, {lo:,.1f} to {hi:,.1f} ({step.source}); tokens/s/GPU {tokens_per_s:,.0f}, "
            f"{tokens_per_s / step.high:,.0f} to {tokens_per_s / step.low:,.0f}; ")
    memory = memory_range(system)
    mlo, mhi = memory.of(memory_gb)
    return text + f"memory {memory_gb:.1f} GB per GPU, {mlo:.1f} to {mhi:.1f} ({memory.source})"
