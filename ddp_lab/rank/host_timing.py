"""Host work the step-time predictor needs and a training step does not time by itself, timed in a
profiled run (profile=true) on rank 0 with the rank's own threads, while the other ranks wait: copies
into a used and a new buffer (flat's and fsdp's), adding into and zeroing a buffer (gradients as bucket
views), and PowerSGD's three phases on the model's matrices, with the strategy's own functions.
rank/profiler.py writes them into phases.json (`host`); `python -m ddp_lab.predict fit` reads them there
and runs nothing of torch's.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from ddp_lab.strategies.powersgd import compress_p_, compress_q_, decompress_

HOST_OPS = {
    "copy": "torch.cat into a buffer used before (flat's copy back into the gradients)",
    "fresh_copy": "torch.cat into a buffer allocated for it (flat's flatten, fsdp's copies: a new buffer every "
                  "step, the first touch of each page costs a fault, several times the copy)",
    "add": "a.add_(b) (autograd accumulating a gradient into a bucket slice instead of keeping it)",
    "zero": "a.zero_() (a bucket zeroed before the forward that fills it)",
}


def host_GBps(op: str, nbytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """Bytes (of the destination) per second of `op` (HOST_OPS) on this host, the best of `repeats`."""
    parts = list(torch.ones(nbytes // 4).chunk(8))
    out, other = torch.cat(parts), torch.ones(nbytes // 4)
    run = {"copy": lambda: torch.cat(parts, out=out), "fresh_copy": lambda: torch.cat(parts),
           "add": lambda: out.add_(other), "zero": lambda: out.zero_()}[op]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def powersgd_work(shapes: list[list[int]], repeats: int = 5) -> dict:
    """PowerSGD's compute on this host for matrices of `shapes` at rank 1 (a thin factor's matmul costs
    about a pass over the matrix at any small rank), each phase over every matrix in turn as the strategy
    runs it, so each matrix comes from memory, not cache (one at a time, repeated, the tiny model's came
    out at half): 1, the error added and P = M Q (with Q's QR); 2, P's QR and Q = M^T P; 3, the error
    kept and M = P Q^T written. `phase_ms` the median of `repeats`, over `numel` elements; a bucket's
    share is its matrices' share."""
    shapes = [s for s in shapes if len(s) >= 2]
    if not shapes:
        return {"phase_ms": [0.0, 0.0, 0.0], "numel": 0}
    matrices = []
    for shape in shapes:
        n, m = shape[0], math.prod(shape[1:])
        matrix, error, p, q = torch.randn(n, m), torch.randn(n, m), torch.randn(n, 1), torch.randn(m, 1)
        matrices.append([lambda a=(matrix, p, q, error): compress_p_(*a), lambda a=(matrix, p, q): compress_q_(*a),
                         lambda a=(matrix, p, q, error): decompress_(*a)])
    phase_ms = []
    for k in range(3):
        laps = []
        for _ in range(repeats + 1):  # the first touches every buffer once
            start = time.perf_counter()
            for phases in matrices:
                phases[k]()
            laps.append((time.perf_counter() - start) * 1e3)
        phase_ms.append(statistics.median(laps[1:]))
    return {"phase_ms": phase_ms, "numel": sum(math.prod(s) for s in shapes)}


def host_timings(shapes: list[list[int]]) -> dict:
    """What phases.json's `host` holds: each HOST_OPS rate (`OP_GBps`) and PowerSGD's work."""
    return {**{f"{op}_GBps": host_GBps(op) for op in HOST_OPS}, "powersgd": powersgd_work(shapes)}
