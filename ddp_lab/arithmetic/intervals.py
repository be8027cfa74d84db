"""Interval arithmetic: unions, intersections and differences of [start, end] spans.

One home for it: the comm figures of a step (strategies/comm_stats.py: how long collectives were in
flight) and the trace analysis (compute during comm) both measure time as unions of intervals, so
concurrent or nested spans are never counted twice. Units are whatever the caller uses.
"""

from __future__ import annotations

Interval = tuple[float, float]


def merge(intervals) -> list[Interval]:
    """Sorted, disjoint union of [start, end] intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def total(intervals) -> float:
    return sum(e - s for s, e in merge(intervals))


def intersect(a, b) -> list[Interval]:
    """Union(a) ∩ union(b), as disjoint intervals (two-pointer sweep)."""
    a, b = merge(a), merge(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b) -> list[Interval]:
    """Union(a) minus union(b)."""
    out, b = [], merge(b)
    for start, end in merge(a):
        cur = start
        for bs, be in b:
            if be <= cur or bs >= end:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
            if cur >= end:
                break
        if cur < end:
            out.append((cur, end))
    return out
