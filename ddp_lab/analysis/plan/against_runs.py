"""The planner held against layouts measured on this machine (benchmarks/plan_check.py; docs/measured/plan.md).

Each measured row is a layout the planner enumerates, run by launch.py on the lab's emulated nodes, with its p50 step.
Per rank count: the planner's predicted step beside the measured one, the rank correlation of the two orders, what
running the planner's pick costs against the measured best (measured step of the pick over the best's; the pick is
the first in the planner's own order, which lists layouts it cannot tell apart simplest first and, where even that
ties, in the order it enumerates them: until 2026-11-30 the rows' order decided those, so a tie of schedules went to
1F1B's job, first by name, where the planner picks GPipe), and the median and
worst error. Nothing here is fitted to these rows: the predictions come from this_machine.json, measured
before the sweep ran.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ddp_lab.analysis.plan.host import HostSystem
from ddp_lab.analysis.plan.price import Layout, price
from ddp_lab.analysis.plan.ranges import STEP
from ddp_lab.analysis.plan.search import layouts, simplest_first
from ddp_lab.analysis.plan.shapes import Shape
from ddp_lab.analysis.predict.validate import spearman


@dataclass(frozen=True)
class Scored:
    gpus: int
    rows: list[dict]          # layout, measured_ms, predicted_ms, error, terms
    rho: float
    pick: dict                # the planner's fastest predicted, as measured
    best: dict                # the measured fastest
    median_abs_error: float
    worst: dict

    @property
    def pick_over_best(self) -> float:
        return self.pick["measured_ms"] / self.best["measured_ms"]

    @property
    def rho_ceiling(self) -> float:
        """The most `rho` could be with these predictions (`rank_ceiling`)."""
        return rank_ceiling([r["predicted_ms"] for r in self.rows])


def rank_ceiling(predicted: list[float]) -> float:
    """The most Spearman's correlation can score against `predicted`: ties take their mean rank, so where layouts
    are priced alike no measured order scores 1 (two strategies under three schedules priced alike: +0.878). It is
    what the measured order scores when it agrees with the predicted one wherever that does not tie."""
    if len(predicted) < 2:
        return 1.0
    order = sorted(range(len(predicted)), key=predicted.__getitem__)
    agreeing = [0] * len(predicted)
    for rank, i in enumerate(order):
        agreeing[i] = rank
    return spearman(predicted, agreeing)


def layout_of(row: dict) -> Layout:
    return Layout(**{k: row[k] for k in ("dp", "tp", "pp", "cp", "strategy", "schedule", "microbatches",
                                         "checkpointing", "stages_per_rank")})


def score(shape: Shape, system_for, sequences: int, measured: list[dict]) -> list[Scored]:
    """`measured`: rows with a layout's fields, `gpus` and `measured_ms` (failed jobs left out by the caller);
    `system_for(gpus)`: the HostSystem for that many ranks."""
    out = []
    for gpus in sorted({r["gpus"] for r in measured}):
        system: HostSystem = system_for(gpus)
        rows, order = [], []
        # between layouts simplest_first cannot tell apart, the planner keeps its enumeration's order (a stable sort)
        enumerated = {lay: i for i, lay in enumerate(layouts(shape, system, gpus, sequences))}
        for r in (r for r in measured if r["gpus"] == gpus):
            p = price(shape, system, layout_of(r), sequences)
            rows.append({**r, "predicted_ms": p.step_ms, "error": p.step_ms / r["measured_ms"] - 1,
                         "terms": p.terms, "describe": p.layout.describe(), "predicted_bytes": p.memory["held"],
                         "predicted_total_bytes": p.memory["total"]})
            order.append((simplest_first(p), enumerated.get(p.layout, len(enumerated))))
        if not rows:
            continue
        rho = spearman([r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows]) if len(rows) > 1 else 1.0
        pick = rows[min(range(len(rows)), key=order.__getitem__)]  # first in the planner's own order
        best = min(rows, key=lambda r: r["measured_ms"])
        worst = max(rows, key=lambda r: abs(r["error"]))
        out.append(Scored(gpus, rows, rho, pick, best, statistics.median(abs(r["error"]) for r in rows), worst))
    return out


def markdown(scored: list[Scored]) -> list[str]:
    """The tables of docs/measured/plan.md: one summary line per rank count (its rank correlation with the most it
    could be where prices tie so that it cannot reach 1), then every layout."""
    lines = ["| ranks | layouts | rank correlation | planner's pick, measured | measured best | pick / best | "
             "best inside the pick's range | median \\|error\\| | worst error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in scored:
        low, high = STEP["this-machine"].of(s.pick["predicted_ms"])
        inside = "yes" if low <= s.best["measured_ms"] <= high else "no"
        rho = f"{s.rho:+.2f}" + (f" (at most {s.rho_ceiling:+.2f})" if s.rho_ceiling < 0.995 else "")
        lines.append(f"| {s.gpus} | {len(s.rows)} | {rho} | {s.pick['describe']}: {s.pick['measured_ms']:.0f} "
                     f"ms | {s.best['describe']}: {s.best['measured_ms']:.0f} ms | {s.pick_over_best:.2f}x | "
                     f"{inside} ({s.best['measured_ms']:.0f} in {low:.0f} to {high:.0f}) | "
                     f"{s.median_abs_error:.0%} | {s.worst['error']:+.0%} ({s.worst['describe']}) |")
    with_memory = [r for s in scored for r in s.rows if r.get("measured_bytes")]
    if with_memory:
        ratios = sorted(r["measured_bytes"] / r["predicted_bytes"] for r in with_memory)
        near = sum(1 for x in ratios if abs(x - 1) <= 0.1)
        lines += ["", f"Memory per rank, the census's most (state and activations' peak) over the planner's held "
                  f"figure (its busier stage's state and saved activations; its total, which decides a fit, adds "
                  f"the log-softmax's gradient): {near} of {len(ratios)} within 10%, median "
                  f"{statistics.median(ratios):.2f}, from {ratios[0]:.2f} to {ratios[-1]:.2f}."]
    for s in scored:
        lines += ["", f"{s.gpus} ranks, fastest measured first (ms per step; terms predicted):", "",
                  "| layout | measured | predicted | error | compute | recompute | micro | bubble | p2p | tp | cp | dp "
                  "| optimizer | MiB, census / planner |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(s.rows, key=lambda r: r["measured_ms"]):
            t = r["terms"]
            lines.append(f"| {r['describe']} | {r['measured_ms']:.0f} | {r['predicted_ms']:.0f} | {r['error']:+.0%} | "
                         + " | ".join(f"{t[k]:.0f}" for k in ("compute", "recompute", "micro", "bubble", "p2p", "tp",
                                                                "cp", "dp", "optimizer")) + f" | {_memory(r)} |")
    return lines


def _memory(row: dict) -> str:
    if not row.get("measured_bytes"):
        return "-"
    return f"{row['measured_bytes'] / 2**20:.1f} / {row['predicted_bytes'] / 2**20:.1f}"
