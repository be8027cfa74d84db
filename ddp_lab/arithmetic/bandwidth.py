"""The nccl-tests arithmetic that turns a collective's times into bandwidth (the timed loop itself
is tasks/allreduce.py's).

Conventions (nccl-tests, doc/PERFORMANCE.md), so numbers compare with what people already know:

- `nbytes` is the size of the whole message: the buffer that is all-reduced, broadcast or reduced, the
  *input* of a reduce-scatter (n chunks), the *output* of an all-gather (n chunks).
- algbw = nbytes / time. It answers "how fast did this call move my tensor".
- busbw = algbw x factor, with factor 2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter and
  all-gather, 1 for broadcast and reduce. It is what each rank's link carried under the optimal (ring)
  algorithm, so it is comparable across world sizes and ops and against the hardware's peak.
- GB/s means 1e9 bytes per second (nccl-tests), while sizes are given in MiB (2^20 bytes).

An iteration ends when the slowest rank ends (`combine_rank_times`).
"""

from __future__ import annotations

import numpy as np

from ddp_lab.arithmetic.stats import summarize
from ddp_lab.spec.choices import CollectiveOp
from ddp_lab.spec.figures import ALGBW, BUSBW, LATENCY
from ddp_lab.units import GB

OPS = tuple(op.value for op in CollectiveOp)


def bus_factor(op: str, world_size: int) -> float:
    """Bytes each rank's link carries per byte of message, for the ring algorithm (nccl-tests)."""
    n = world_size
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {n}")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(OPS)}")


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: message size over time."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {seconds}")
    return nbytes / seconds


def busbw(op: str, nbytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth in bytes/s: algbw scaled to what each link carried (see `bus_factor`)."""
    return algbw(nbytes, seconds) * bus_factor(op, world_size)


def latency_summary(seconds) -> dict:
    """mean, std, p50, p90, p95, min, max of per-iteration times, in milliseconds."""
    out = summarize([t * 1e3 for t in seconds])
    if out is None:
        raise ValueError("no timings to summarize")
    return out


def combine_rank_times(per_rank: list[list[float]]) -> list[float]:
    """Per iteration, the slowest rank's time: a collective is done when its last rank is done."""
    lengths = {len(t) for t in per_rank}
    if len(lengths) != 1:
        raise ValueError(f"ranks report different iteration counts: {sorted(lengths)}")
    return [float(x) for x in np.max(np.asarray(per_rank, dtype=float), axis=0)]


def summarize_collective(op: str, nbytes: int, world_size: int, seconds: list[float]) -> dict:
    """The figures a benchmark job records: latency summary plus algbw/busbw at the median time.

    Bandwidth uses the median (p50), not the mean nccl-tests uses, because on a shared CPU host a
    few descheduled iterations would otherwise dominate; `latency_ms` keeps the mean and spread.
    """
    lat = latency_summary(seconds)
    t50 = lat["p50"] / 1e3
    return {"op": op, "bytes": int(nbytes), "world_size": world_size, "iters": len(seconds),
            LATENCY.key: lat,
            ALGBW.key: algbw(nbytes, t50) / GB,
            BUSBW.key: busbw(op, nbytes, t50, world_size) / GB,
            "bus_factor": bus_factor(op, world_size)}


def message_numel(nbytes: int, world_size: int, element_size: int = 4) -> int:
    """Elements in the message: nbytes rounded down to a multiple of world_size elements.

    Reduce-scatter and all-gather split the message into n equal chunks, so e.g. 1 MiB of float32
    at 6 ranks becomes 262140 elements. Record `message_bytes` (the size actually moved), not the
    size asked for, when computing bandwidth.
    """
    numel = (nbytes // element_size) // world_size * world_size
    if numel <= 0:
        raise ValueError(f"{nbytes} bytes is less than one {element_size}-byte element per rank "
                         f"at world_size={world_size}")
    return numel


def message_bytes(nbytes: int, world_size: int, element_size: int = 4) -> int:
    return message_numel(nbytes, world_size, element_size) * element_size


def bytes_per_rank(op: str, nbytes: int, world_size: int) -> int:
    """Buffer memory one rank allocates for the benchmark (not counting backend scratch space)."""
    chunk = nbytes // world_size
    return {"all_reduce": nbytes, "broadcast": nbytes, "reduce": nbytes,
            "reduce_scatter": nbytes + chunk, "all_gather": chunk + nbytes}[op]
