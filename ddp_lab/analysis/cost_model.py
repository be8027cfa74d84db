"""A two-parameter model of a collective, and what it predicts for bucketed DDP.

One all-reduce of b bytes is modelled as t(b) = o + b / w: a per-call overhead o (launch,
synchronization, latency of the algorithm's steps) plus the bytes at an effective bandwidth w.
`fit_link` estimates (o, w) from a collective benchmark; `exposed_overhead` and
`best_bucket_bytes` turn them into the bucket size that minimizes the communication backward
does not hide. docs/cost_model.md has the derivation; in one line:

    exposed(n_b) = n_b * o + s / (n_b * w),  n_b* = sqrt(s / (o * w)),  bucket* = sqrt(s * o * w)

`pipeline_exposed` drops that model's assumption that every transfer but the last is hidden
(it simulates buckets queueing on one communication channel during a backward of known length),
for when communication is slower than backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ddp_lab.analysis.records import bucket_groups
from ddp_lab.spec.figures import LATENCY
from ddp_lab.units import MiB


@dataclass(frozen=True)
class LinkFit:
    """t(bytes) = overhead_s + bytes / bandwidth_Bps, fitted from `n_points` (bytes, time) pairs."""

    overhead_s: float
    bandwidth_Bps: float
    n_points: int
    rel_rms: float  # root-mean-square relative residual of the fit: how well a line explains the data

    def predict(self, nbytes):
        return self.overhead_s + np.asarray(nbytes, dtype=float) / self.bandwidth_Bps


def _weighted_line(x, t, weights):
    """Weighted least squares for t = o + beta*x; returns (o, beta)."""
    a = np.stack([np.ones_like(x), x], axis=1) * np.sqrt(weights)[:, None]
    (o, beta), *_ = np.linalg.lstsq(a, t * np.sqrt(weights), rcond=None)
    return o, beta


def fit_link(nbytes, seconds, huber_k: float = 1.5, iterations: int = 20) -> LinkFit:
    """Fit per-call overhead o and bandwidth w to (bytes, seconds) samples.

    Why not plain least squares: benchmark sizes span 1 MiB to 1 GiB, so absolute residuals let
    the largest size decide everything and o comes out as noise (often negative). Instead:

    1. repeated samples of one size are reduced to their median (a descheduled iteration only
       ever makes a sample slower, and the median ignores it);
    2. residuals are relative (weights 1/t^2), so every size counts the same;
    3. Huber reweighting (scale from the median absolute residual) tames any size whose median
       is still off the line;
    4. o is constrained to >= 0: if the unconstrained fit is negative, w is refitted with o = 0.
    """
    x = np.asarray(nbytes, dtype=float).ravel()
    t = np.asarray(seconds, dtype=float).ravel()
    if x.shape != t.shape:
        raise ValueError(f"{x.size} sizes but {t.size} times")
    if np.any(t <= 0) or np.any(x < 0):
        raise ValueError("times must be positive and sizes non-negative")
    sizes = np.unique(x)
    if sizes.size < 2:
        raise ValueError("need at least two distinct message sizes to separate overhead from bandwidth")
    x, t = sizes, np.array([np.median(t[x == s]) for s in sizes])

    robust = np.ones_like(t)
    for _ in range(iterations):
        weights = robust / t**2
        o, beta = _weighted_line(x, t, weights)
        rel = (t - o - beta * x) / t
        scale = 1.4826 * np.median(np.abs(rel - np.median(rel)))
        if scale <= 1e-12:
            break
        u = np.abs(rel) / (huber_k * scale)
        new = np.where(u <= 1, 1.0, 1.0 / np.maximum(u, 1e-12))
        if np.allclose(new, robust):
            break
        robust = new
    weights = robust / t**2
    if o < 0:
        o, beta = 0.0, float(np.sum(weights * x * t) / np.sum(weights * x * x))
    if beta <= 0:
        raise ValueError("time does not grow with message size; cannot fit a bandwidth")
    rel = (t - o - beta * x) / t
    return LinkFit(overhead_s=float(o), bandwidth_Bps=float(1 / beta), n_points=int(x.size),
                   rel_rms=float(np.sqrt(np.mean(rel**2))))


def fit_link_from_summaries(summaries) -> LinkFit:
    """`fit_link` on benchmark jobs' figures (`collectives.summarize_collective` dicts): the
    median latency of each message size. Use jobs of one op, backend and world size."""
    keys = {(s["op"], s["world_size"]) for s in summaries}
    if len(keys) > 1:
        raise ValueError(f"mixing ops / world sizes {sorted(keys)}: fit one link per (op, world_size)")
    return fit_link([s["bytes"] for s in summaries], [s[LATENCY.key]["p50"] / 1e3 for s in summaries])


def exposed_overhead(n_buckets, total_bytes: float, overhead_s: float, bandwidth_Bps: float):
    """Exposed communication of bucketed DDP: n_b*o + s/(n_b*w) (seconds; n_b may be an array).

    Assumes (docs/cost_model.md): every per-call overhead lands on the critical path, and each
    bucket's transfer finishes before the next bucket's gradients are ready, so only the last
    bucket's transfer (which can only start when backward ends) is exposed.
    """
    n = np.asarray(n_buckets, dtype=float)
    if np.any(n < 1):
        raise ValueError("n_buckets must be >= 1")
    out = n * overhead_s + total_bytes / (n * bandwidth_Bps)
    return float(out) if out.ndim == 0 else out


def exposed_vs_bucket_bytes(bucket_bytes, total_bytes: float, overhead_s: float, bandwidth_Bps: float):
    """`exposed_overhead` as a function of bucket size b: s*o/b + b/w, with n_b = s/b >= 1.

    Continuous in b (n_b = s/b, not ceil(s/b)): real buckets close at parameter boundaries, so
    the integer count is not known from b alone; a bucket larger than s is one bucket.
    """
    b = np.minimum(np.asarray(bucket_bytes, dtype=float), total_bytes)
    return exposed_overhead(total_bytes / b, total_bytes, overhead_s, bandwidth_Bps)


def best_bucket_count(total_bytes: float, overhead_s: float, bandwidth_Bps: float) -> int:
    """Integer n_b minimizing `exposed_overhead`: floor or ceil of sqrt(s/(o*w)), at least 1."""
    if overhead_s <= 0:
        raise ValueError("with zero per-call overhead more buckets always help; no finite optimum")
    root = math.sqrt(total_bytes / (overhead_s * bandwidth_Bps))
    candidates = {max(1, math.floor(root)), max(1, math.ceil(root))}
    return min(candidates, key=lambda n: exposed_overhead(n, total_bytes, overhead_s, bandwidth_Bps))


def best_bucket_bytes(total_bytes: float, overhead_s: float, bandwidth_Bps: float) -> float:
    """Bucket size minimizing `exposed_vs_bucket_bytes`: sqrt(s*o*w), at most s."""
    if overhead_s <= 0:
        raise ValueError("with zero per-call overhead more buckets always help; no finite optimum")
    return min(math.sqrt(total_bytes * overhead_s * bandwidth_Bps), float(total_bytes))


def bucket_curve(total_bytes: float, fit: LinkFit, bucket_mb=None, points: int = 200) -> dict:
    """What the report plots beside a measured bucket sweep: predicted exposed ms per bucket size
    (MiB, log-spaced from 0.1 MiB to the whole gradient unless given) and the predicted optimum."""
    if bucket_mb is None:
        bucket_mb = np.geomspace(0.1, max(total_bytes / MiB, 0.2), points)
    bucket_mb = np.asarray(bucket_mb, dtype=float)
    exposed = exposed_vs_bucket_bytes(bucket_mb * MiB, total_bytes, fit.overhead_s, fit.bandwidth_Bps)
    best = best_bucket_bytes(total_bytes, fit.overhead_s, fit.bandwidth_Bps)
    return {"bucket_mb": bucket_mb.tolist(), "exposed_ms": (np.atleast_1d(exposed) * 1e3).tolist(),
            "best_bucket_mb": best / MiB,
            "best_n_buckets": best_bucket_count(total_bytes, fit.overhead_s, fit.bandwidth_Bps),
            "best_exposed_ms": exposed_vs_bucket_bytes(best, total_bytes, fit.overhead_s, fit.bandwidth_Bps) * 1e3}


def pipeline_exposed(n_buckets: int, total_bytes: float, overhead_s: float, bandwidth_Bps: float,
                     backward_s: float) -> float:
    """Exposed communication when buckets queue on one channel during a backward of `backward_s`.

    Bucket i (of n equal ones) is ready at i*T/n; its all-reduce takes c = o + s/(n*w) and starts
    when it is ready and the previous one is done. Exposed = end of the last all-reduce - T
    = max(c, n*c - T*(1 - 1/n)): c when communication keeps up with backward, else the backlog.
    Here o hides behind compute like the transfer does (the opposite extreme to
    `exposed_overhead`); in the backlogged regime the optimum is n_b* = sqrt(T/o).
    """
    n = int(n_buckets)
    if n < 1:
        raise ValueError("n_buckets must be >= 1")
    c = overhead_s + total_bytes / (n * bandwidth_Bps)
    return max(c, n * c - backward_s * (1 - 1 / n))


def simulate_pipeline(n_buckets: int, total_bytes: float, overhead_s: float, bandwidth_Bps: float,
                      backward_s: float) -> float:
    """Event-by-event version of `pipeline_exposed` (the test checks the closed form against it)."""
    n = int(n_buckets)
    c = overhead_s + total_bytes / (n * bandwidth_Bps)
    end = 0.0
    for i in range(1, n + 1):
        end = max(i * backward_s / n, end) + c
    return end - backward_s


# --- a measured bucket sweep against the model -------------------------------------------------

def bucket_predictions(records: list[dict], bench: list[dict], asked: bool = False) -> tuple[list[dict], list[str]]:
    """For each bucket sweep with an all-reduce benchmark at the same world size and backend:
    the fitted link, the predicted curve and best bucket size, and the measured best sizes."""
    predictions, notes = [], []
    groups = bucket_groups(records)
    if asked and not groups:
        notes.append("collective benchmarks given but no bucket sweep (jobs differing only in strategy.bucket_mb)")
    for (strategy, model, ws, backend), group in groups.items():
        summaries = [b["summary"] for b in bench if b.get("status") == "ok"
                     and (b.get("summary") or {}).get("op") == "all_reduce"
                     and b["summary"].get("barrier", True)  # one call alone, as a bucket is
                     and b["summary"].get("world_size") == ws and b["summary"].get("backend") == backend]
        ok = [r for r in group if r["status"] == "ok" and r.get("step_p50_ms") is not None]
        total = [r["comm_bytes_per_step"] for r in ok if r.get("comm_bytes_per_step")]
        if len({s["bytes"] for s in summaries}) < 2:
            if asked or bench:
                notes.append(f"{strategy} bucket sweep at world_size={ws} ({backend}): no all_reduce benchmark "
                             f"with two or more sizes at that world size and backend, so no prediction")
            continue
        if not ok or not total:
            notes.append(f"{strategy} bucket sweep at world_size={ws}: no successful job, so no prediction")
            continue
        try:
            fit = fit_link_from_summaries(summaries)
            s = float(np.median(total))
            best_mb = best_bucket_bytes(s, fit.overhead_s, fit.bandwidth_Bps) / MiB
            sizes = [r["bucket_mb"] for r in ok] + [best_mb]
            # The curve over the measured range (and the optimum), not 0.1 MiB, whose huge
            # predicted overhead would flatten the measured points against the axis.
            curve = bucket_curve(s, fit, np.geomspace(min(sizes) / 2, max(sizes) * 2, 200))
        except ValueError as exc:
            notes.append(f"{strategy} bucket sweep at world_size={ws}: cost model not applicable: {exc}")
            continue
        exposed = [r for r in ok if r.get("exposed_p50_ms") is not None]
        predictions.append({
            "strategy": strategy, "model": model, "world_size": ws, "backend": backend, "total_bytes": s,
            "overhead_s": fit.overhead_s, "bandwidth_Bps": fit.bandwidth_Bps, "rel_rms": fit.rel_rms,
            "benchmark_sizes": len({x["bytes"] for x in summaries}),
            "best_bucket_mb": curve["best_bucket_mb"], "best_n_buckets": curve["best_n_buckets"],
            "curve_bucket_mb": curve["bucket_mb"], "curve_exposed_ms": curve["exposed_ms"],
            "measured_best_step_mb": min(ok, key=lambda r: r["step_p50_ms"])["bucket_mb"],
            "measured_best_exposed_mb": (min(exposed, key=lambda r: r["exposed_p50_ms"])["bucket_mb"]
                                         if exposed else None),
        })
    return predictions, notes
