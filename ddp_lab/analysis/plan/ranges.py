"""How far the planner's figures land from measurement, by its own checks: the range each printed figure comes with.

A predicted step s comes with [s x low, s x high], the measured-over-predicted ratios its checks found for layouts of
that kind (tokens per second per GPU with the same range inverted):

- `this-machine`: every layout of tiny measured on this project's VMs, 486 of them, priced as the planner prices them
  now with this machine's calibration (docs/measured/plan_rescored.md): the 166 of 2026-11-28 (docs/measured/
  plan.md: the 58 checked and the 108 held out), the 68 of 2026-11-29 (the unseen check twice, FSDP2 under a
  pipeline) and the 252 of the nine checks since, at contexts 128 to 512; the 10th to the 90th percentile (8 in 10
  layouts fell inside). Every run here, not one day's: the same command measured up to a third apart from one run to
  the next (docs/measured/plan_unseen_rerun.md), and this VM's floor at context 256 measured up to 1.3x slower one
  morning than at noon the same day (docs/measured/plan_floor_curve.md). Recomputed on 2026-11-30 after FSDP2's
  accumulation was priced as the lab issues it and TP's all-reduces with their wait on shared cores
  (docs/measured/plan_tp_wait.md), from all the rows then on record, before the check at context 224 ran (0.94x to
  1.42x from the 430 before context 320's and 160's, as priced before those changes; 0.85x to 1.31x from the first
  two days' 234, as priced then); and again after a pipeline's ranks were priced sharing the cores as the
  scheduler shares them (cores.py; 0.92x to 1.38x before), after selective checkpointing's cost was calibrated
  (0.91x to 1.36x before), after the sharded strategies' collectives were priced on the lab's own rings
  (docs/measured/plan_lab_rings.md; 0.91x to 1.35x before) and after each context-parallel ring collective was priced
  at least its calibrated cost on shared cores (docs/measured/plan_context_collective.md; 0.91x to 1.31x before);
- a GPU system: the 11 published torchtitan Llama 3.1 rows (`python -m ddp_lab.predict published`, at its calibrated
  MFU), from the least to the most; and memory, published over priced, from the least to the most (the planner
  counts what ZeRO and the activations need, not the allocator's reserve or the communication buffers).

- this machine's memory: the census's most a rank held (its model state and activations' peak) over the planner's
  printed figure (its total: what the census counts and the log-softmax's gradient, which the census cannot see), on
  the 28 layouts of the unseen check at twice the batch run again with the census and the memory pricing of
  2026-11-30 (docs/measured/plan_unseen_batch.md), 10th to 90th percentile; recomputed after the lab's block under
  TP was counted with its norms whole (0.81x to 0.97x before), and after a full-checkpointing peak was counted with
  the larger of its recompute and the loss's log-softmax, not both (docs/measured/plan_full_peak.md; 0.80x to 0.95x
  before).

tests/unit/test_plan.py recomputes every range from those rows: a change to the pricing that moves one fails there
until the figures here are made again.
"""

from __future__ import annotations

import math
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
    "this-machine": Range(0.89, 1.30, "8 in 10 of 486 layouts measured here"),
    "gpu": Range(0.83, 2.64, "11 published torchtitan runs"),
}
"""Measured step over predicted, by the kind of system (module docstring)."""

MEMORY = {"this-machine": Range(0.84, 0.97, "8 in 10 of 28 layouts' census here"),
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
    ms, lo, hi = shown(step_ms, *step.of(step_ms))
    text = (f"step {ms} ms, {lo} to {hi} ({step.source}); tokens/s/GPU {tokens_per_s:,.0f}, "
            f"{tokens_per_s / step.high:,.0f} to {tokens_per_s / step.low:,.0f}; ")
    memory = memory_range(system)
    gb, mlo, mhi = shown(memory_gb, *memory.of(memory_gb))
    return text + f"memory {gb} GB per GPU, {mlo} to {mhi} ({memory.source})"


def shown(*figures: float) -> list[str]:
    """A figure and its range at one precision, enough for two significant digits of the least: 0.15 GB, 0.12 to
    0.14, where one decimal printed 0.2, 0.1 to 0.1 (a range of no width, and not the figure's 0.80x to 0.95x);
    one decimal at least."""
    least = min((abs(f) for f in figures if f), default=1.0)
    decimals = min(6, max(1, 1 - math.floor(math.log10(least))))
    return [f"{f:,.{decimals}f}" for f in figures]
