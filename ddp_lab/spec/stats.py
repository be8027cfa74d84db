"""Summaries of per-step measurements: the figures every table, W&B summary and report share."""

from __future__ import annotations

import numpy as np

SUMMARY_KEYS = ("mean", "std", "p50", "p90", "p95", "min", "max")


def summarize(values) -> dict | None:
    """mean, std, p50, p90, p95, min, max of a sequence; None when it is empty."""
    a = np.asarray([v for v in values if v is not None], dtype=float)
    if a.size == 0:
        return None
    p50, p90, p95 = np.percentile(a, [50, 90, 95])
    return {"mean": float(a.mean()), "std": float(a.std()), "p50": float(p50), "p90": float(p90),
            "p95": float(p95), "min": float(a.min()), "max": float(a.max())}
