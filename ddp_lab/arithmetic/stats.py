"""Summaries of per-step measurements: the figures every table, W&B summary and report share, and the
summary of a training job's steps, which the rank writes into results.json and the launcher makes for
a job that failed after streaming some steps."""

from __future__ import annotations

import numpy as np

from ddp_lab.spec.figures import (
    COLLECTIVES,
    COMM,
    COMM_BYTES,
    EXPOSED,
    LOSS,
    TP_COLLECTIVES,
    TP_COMM_BYTES,
    VAL_LOSS,
    training_figures,
)

SUMMARY_KEYS = ("mean", "std", "p50", "p90", "p95", "min", "max")


def summarize(values) -> dict | None:
    """mean, std, p50, p90, p95, min, max of a sequence; None when it is empty."""
    a = np.asarray([v for v in values if v is not None], dtype=float)
    if a.size == 0:
        return None
    p50, p90, p95 = np.percentile(a, [50, 90, 95])
    return {"mean": float(a.mean()), "std": float(a.std()), "p50": float(p50), "p90": float(p90),
            "p95": float(p95), "min": float(a.min()), "max": float(a.max())}


TRAINING_SUMMARIZED = tuple(f.key for f in training_figures() if f.summarized)
"""Per-step figures a training job's summary gives mean, std and percentiles of (spec/figures.py says which)."""


def summarize_training(steps: list[dict], warmup_steps: int) -> dict:
    """Summaries over the measured steps (after the first `warmup_steps` this run made: a run started from a
    checkpoint warms up again), plus overlap % where comm was in flight."""
    first = steps[0]["step"] if steps else 0
    measured = [s for s in steps if s["step"] >= first + warmup_steps]
    summary = {key: summarize(s.get(key) for s in measured) for key in TRAINING_SUMMARIZED}
    total = sum(s.get(COMM.key, 0.0) for s in measured)
    exposed = sum(s.get(EXPOSED.key, 0.0) for s in measured)
    summary["overlap_pct"] = max(0.0, 100.0 * (1.0 - exposed / total)) if total > 0 else None
    summary["measured_steps"] = len(measured)
    summary["final_loss"] = steps[-1].get(LOSS.key) if steps else None
    held_out = [s[VAL_LOSS.key] for s in steps if s.get(VAL_LOSS.key) is not None]
    summary["final_val_loss"] = held_out[-1] if held_out else None
    if measured:  # means: local_sgd sends only on sync steps, powersgd's first steps are uncompressed
        for key, out in ((COLLECTIVES.key, "collectives_per_step"), (COMM_BYTES.key, "comm_bytes_per_step"),
                         (TP_COLLECTIVES.key, "tp_collectives_per_step"),
                         (TP_COMM_BYTES.key, "tp_comm_bytes_per_step")):
            values = [s[key] for s in measured if s.get(key) is not None]
            summary[out] = sum(values) / len(values) if values else None
    return summary


def summarize_steps(steps: list[dict], cfg) -> dict:
    """A job's summary from its streamed steps (steps.jsonl), for a job that ended before writing one: a
    training job's figures; {} for the collective benchmark, where a partial sweep of sizes is no figure."""
    if cfg["task"]["name"] != "train":
        return {}
    return summarize_training(steps, cfg["train"]["warmup_steps"])
