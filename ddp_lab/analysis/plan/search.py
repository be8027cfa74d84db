"""Every layout of a GPU count that divides, priced and ranked (price.py): what `python -m ddp_lab.plan` prints.

Not brute force over impossible layouts: tp only over divisors that split the heads and the key/value heads and stay
within two nodes' GPUs, pp at most the blocks, cp only where the context splits into 2 x cp zigzag chunks, dp only
where it divides the batch's sequences; micro-batch counts a handful per layout (1, p, 2p, 4p, 8p and the most the
replica's sequences allow: the bubble falls with m, the per-micro-batch cost rises), interleaving at 2 virtual stages
where the stage's blocks split in two. What does not fit the memory is dropped, and the nearest miss kept to say by
how much.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ddp_lab.analysis.plan.price import (
    CHECKPOINTING,
    HEADROOM,
    SCHEDULES,
    STRATEGIES,
    Layout,
    Priced,
    price,
    stage_blocks,
)
from ddp_lab.analysis.plan.shapes import Shape
from ddp_lab.analysis.predict.systems import System
from ddp_lab.spec.parallel import checkpointing_problem
from ddp_lab.spec.strategies import SPECS

MAX_CP = 16


class PlanError(ValueError):
    """Input with no answer, said in one line (the command exits 2)."""


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def microbatch_counts(per_replica: int, pp: int) -> list[int]:
    """A handful of micro-batch counts dividing a replica's sequences: 1 (none) and p, 2p, 4p, 8p and the most,
    each rounded to the nearest divisor at or above it."""
    options = divisors(per_replica)
    wanted = {1, per_replica} | {k * pp for k in (1, 2, 4, 8)}
    out = set()
    for w in wanted:
        above = [d for d in options if d >= w]
        if above:
            out.add(above[0])
    return sorted(m for m in out if pp == 1 or m >= pp) or [per_replica]


def layout_problem(shape: Shape, layout: Layout, sequences: int) -> str | None:
    """Why `layout` cannot run `shape` on a batch of `sequences`, in one line, or None."""
    lay = layout
    if problem := shape.tp_problem(lay.tp):
        return problem
    if lay.pp * lay.stages_per_rank > shape.layers:
        virtual = f" x {lay.stages_per_rank} virtual" if lay.stages_per_rank > 1 else ""
        return f"pp {lay.pp}{virtual} is more stages than the {shape.layers} blocks"
    if lay.cp > 1 and shape.context % (2 * lay.cp):
        return f"cp {lay.cp}: the context {shape.context} does not split into 2 x cp zigzag chunks"
    if sequences % lay.dp or (sequences // lay.dp) % lay.microbatches:
        return (f"{sequences} sequences do not split into dp {lay.dp} replicas of {lay.microbatches} equal "
                "micro-batches")
    if lay.pp > 1 and lay.schedule != "gpipe" and lay.microbatches < lay.pp:
        return f"{lay.schedule} needs at least pp ({lay.pp}) micro-batches, got {lay.microbatches}"
    return None


def lab_refusal(layout: Layout) -> str | None:
    """Why launch.py refuses `layout` for a lab model, in its own words (the strategy's spec on the mesh, activation
    checkpointing on a mesh), or None: the planner ranks only what the lab runs as priced."""
    try:
        SPECS[layout.strategy]().check_mesh(layout.tp, layout.pp, layout.schedule, layout.cp)
    except ValueError as exc:
        return str(exc)
    return checkpointing_problem(layout.checkpointing, layout.pp, layout.schedule)


def layouts(shape: Shape, system: System, gpus: int, sequences: int, strategies=tuple(STRATEGIES),
            checkpointing=CHECKPOINTING, schedules=SCHEDULES):
    """Every layout the planner prices for `gpus` GPUs and a batch of `sequences` (module docstring)."""
    for tp in divisors(gpus):
        if tp > 2 * system.gpus_per_node or shape.tp_problem(tp):
            continue
        for pp in divisors(gpus // tp):
            if pp > shape.layers:
                continue
            for cp in divisors(gpus // (tp * pp)):
                if cp > MAX_CP or (cp > 1 and shape.context % (2 * cp)):
                    continue
                dp = gpus // (tp * pp * cp)
                if sequences % dp:
                    continue
                for m in microbatch_counts(sequences // dp, pp):
                    for schedule in (schedules if pp > 1 else ("1f1b",)):
                        v = 2 if schedule == "interleaved_1f1b" else 1
                        if v > 1 and (stage_blocks(shape, pp) % v or m % pp or pp * v > shape.layers):
                            continue
                        for strategy in (strategies if dp * cp > 1 else ("torch_ddp",)):
                            for ac in checkpointing:
                                if ac == "selective" and shape.ffn:  # no attention to recompute
                                    continue
                                yield Layout(dp, tp, pp, cp, strategy, schedule, m, ac, v)


@dataclass
class Plan:
    ranked: list[Priced]
    priced: int
    nearest_miss: Priced | None = None
    dropped: dict = field(default_factory=dict)  # why layouts were dropped: count


def plan(shape: Shape, system: System, gpus: int, sequences: int, capacity: float | None = None,
         mfu: float | None = None, attention_mfu: float | None = None, headroom: float = HEADROOM, lab: bool = False,
         **choices) -> Plan:
    """Every layout priced; those that fit ranked by predicted tokens per second per GPU, best first. `lab`: a lab
    model, whose layouts the launcher refuses are left out (`lab_refusal`), counted in `dropped` by their reason."""
    if gpus < 1:
        raise PlanError(f"--gpus must be >= 1, got {gpus}")
    if sequences < 1:
        raise PlanError("the global batch is less than one sequence of the context")
    fitting, miss, count, dropped = [], None, 0, {}
    for layout in layouts(shape, system, gpus, sequences, **choices):
        count += 1
        refused = lab_refusal(layout) if lab else None
        if refused:
            dropped[refused] = dropped.get(refused, 0) + 1
            continue
        priced = price(shape, system, layout, sequences, mfu, capacity, attention_mfu, headroom)
        if priced.fits:
            fitting.append(priced)
        elif miss is None or priced.memory["total"] < miss.memory["total"]:
            miss = priced
    if count == 0:
        heads = "" if shape.ffn else f"heads {shape.heads}, kv heads {shape.kv_heads}, "
        raise PlanError(f"no layout of {gpus} GPUs divides {shape.name} ({heads}{shape.layers} blocks, context "
                        f"{shape.context}) and a batch of "
                        f"{sequences} sequences")
    fitting.sort(key=simplest_first)
    return Plan(fitting, count, miss, dropped)


def simplest_first(p: Priced) -> tuple:
    """The rank order: predicted tokens per second per GPU (to 0.1%), then, between layouts the formulas cannot tell
    apart, the simpler: the lower ZeRO stage, fewer axes, fewer micro-batches, less recomputation."""
    lay = p.layout
    return (-round(math.log(max(p.tokens_per_s_per_gpu, 1e-30)) / math.log(1.001)),
            STRATEGIES[lay.strategy], (lay.tp > 1) + (lay.pp > 1) + (lay.cp > 1), lay.microbatches,
            CHECKPOINTING.index(lay.checkpointing))


def why_runner_up_lost(best: Priced, runner: Priced) -> str:
    """The term that differs most between the two, in one line."""
    diffs = {k: runner.terms[k] - best.terms[k] for k in best.terms}
    name, extra = max(diffs.items(), key=lambda kv: kv[1])
    slower = runner.tokens_per_s_per_gpu and best.tokens_per_s_per_gpu / runner.tokens_per_s_per_gpu - 1
    if slower < 0.001:
        return (f"the runner-up ({runner.layout.describe()}) is predicted as fast: the formulas cannot tell them "
                "apart, and the simpler is listed first")
    return f"the runner-up ({runner.layout.describe()}) is {slower:.1%} slower: {extra:.1f} ms more {name}"
