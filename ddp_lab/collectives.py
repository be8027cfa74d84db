"""Collective benchmark: one timed loop, and the nccl-tests arithmetic that turns times into bandwidth.

Conventions (nccl-tests, doc/PERFORMANCE.md), so numbers compare with what people already know:

- `nbytes` is the size of the whole message: the buffer that is all-reduced or broadcast, the
  *input* of a reduce-scatter (n chunks), the *output* of an all-gather (n chunks).
- algbw = nbytes / time. It answers "how fast did this call move my tensor".
- busbw = algbw x factor, with factor 2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter and
  all-gather, 1 for broadcast. It is what each rank's link carried under the optimal (ring)
  algorithm, so it is comparable across world sizes and ops and against the hardware's peak.
- GB/s means 1e9 bytes per second (nccl-tests), while sizes are given in MiB (2^20 bytes).

Per-iteration times are host clocks around one call with the device synchronized on both sides
(a host timer around an async launch measures only the launch). Ranks are lined up by a barrier
before every iteration, outside the timed region, so one rank's late arrival is not billed as the
others' collective time; an iteration ends when the slowest rank ends (`combine_rank_times`).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from ddp_lab.distributed import synchronize
from ddp_lab.stats import summarize

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
GB = 1e9
MiB = 2**20


def bus_factor(op: str, world_size: int) -> float:
    """Bytes each rank's link carries per byte of message, for the ring algorithm (nccl-tests)."""
    n = world_size
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {n}")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    if op == "broadcast":
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
            "latency_ms": lat,
            "algbw_GBps": algbw(nbytes, t50) / GB,
            "busbw_GBps": busbw(op, nbytes, t50, world_size) / GB,
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
    return {"all_reduce": nbytes, "broadcast": nbytes,
            "reduce_scatter": nbytes + chunk, "all_gather": chunk + nbytes}[op]


def resolve_collective(op: str, numel: int, device: torch.device, dtype=torch.float32,
                       group=None) -> tuple[Callable[[], None], str, dict]:
    """Buffers and a zero-argument callable running `op` once, plus the name of the API it uses.

    Tensor ("single") APIs are preferred: they move one contiguous buffer, as the strategies do.
    torch 2.13 deprecates `reduce_scatter_tensor`/`all_gather_into_tensor` in favour of
    `reduce_scatter_single`/`all_gather_single`, and its gloo supports all of them; older torch
    lacks the `_single` names and older gloo lacks the tensor forms, hence the fallbacks, tried
    once with a real call (an unsupported op raises on every rank alike, before any traffic).
    The last resort for reduce-scatter is an all-reduce of the whole message (named
    `all_reduce_emulation`; its bus factor then is all-reduce's, so report it as such).
    Returns (run, api_name, buffers).
    """
    n = dist.get_world_size(group)
    if numel % n:
        raise ValueError(f"numel={numel} is not a multiple of world_size={n}; use message_numel")
    full = torch.zeros(numel, device=device, dtype=dtype)
    chunk = torch.zeros(numel // n, device=device, dtype=dtype)
    bufs = {"full": full, "chunk": chunk}

    if op == "all_reduce":
        candidates = [("all_reduce", lambda: dist.all_reduce(full, group=group))]
    elif op == "broadcast":
        src = 0 if group is None else dist.get_global_rank(group, 0)
        candidates = [("broadcast", lambda: dist.broadcast(full, src=src, group=group))]
    elif op == "reduce_scatter":
        candidates = [(name, (lambda f=getattr(dist, name): f(chunk, full, group=group)))
                      for name in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, name)]
        candidates.append(("reduce_scatter", lambda: dist.reduce_scatter(chunk, list(full.chunk(n)), group=group)))
        candidates.append(("all_reduce_emulation", lambda: dist.all_reduce(full, group=group)))
    elif op == "all_gather":
        candidates = [(name, (lambda f=getattr(dist, name): f(full, chunk, group=group)))
                      for name in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, name)]
        candidates.append(("all_gather", lambda: dist.all_gather(list(full.chunk(n)), chunk, group=group)))
    else:
        raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(OPS)}")

    errors = []
    for name, run in candidates:
        try:
            run()
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            errors.append(f"{name}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            continue
        return run, name, bufs
    raise RuntimeError(f"{op} is not supported by backend {dist.get_backend(group)}: " + "; ".join(errors))


def benchmark_collective(op: str, nbytes: int, iters: int, warmup: int, device: torch.device,
                         dtype=torch.float32, group=None, barrier: bool = True,
                         info: dict | None = None) -> list[float]:
    """Time `iters` calls of `op` on `nbytes` (see `message_bytes`) after `warmup` untimed ones.

    The process group must already be initialized. Returns this rank's per-iteration seconds;
    gather them from every rank and combine with `combine_rank_times`. Pass a dict as `info` to
    learn the torch API that ran (`api`) and the bytes actually moved (`bytes`), for results.json.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    n = dist.get_world_size(group)
    numel = message_numel(nbytes, n, torch.empty((), dtype=dtype).element_size())
    run, api, _ = resolve_collective(op, numel, device, dtype, group)  # its trial call is warm-up 0
    if info is not None:
        info.update(api=api, bytes=numel * torch.empty((), dtype=dtype).element_size())
    for _ in range(max(warmup - 1, 0)):
        run()
    synchronize(device)
    times = []
    for _ in range(iters):
        if barrier:
            dist.barrier(group=group)
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times
