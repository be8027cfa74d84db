"""`fit`: a step-time model of this machine from a collective sweep and one profiled training run.

Two halves, written to one JSON file a person can read (`save` / `load`):

- collectives: for each backend, op, dtype and world size of a `task=allreduce` sweep, latency
  alpha and bandwidth beta of t(b) = alpha + b / beta (cost_model.fit_link: medians, relative
  residuals, Huber, alpha >= 0), and across world sizes the ring form
  t = steps(n) * alpha + bus_factor(n) * b / busbw, used for a world size the sweep did not run;
  jobs timed back to back (task.barrier=false) get the same, apart (`back_to_back`).
- compute: from the profiled run's JOB/phases.json (rank/profiler.py's GradientClock), the median
  forward, backward and optimizer times, the remainder of the step, and when each parameter's
  gradient became ready, all as *work*: the profiled run overlapped communication with backward,
  and on shared cores that slowed backward, so the time spent with communication in flight is
  divided by the fitted slowdown. `contention`: how much slower compute runs while a collective is
  in flight (s_c), a collective while compute runs (s_m), and what launching a collective from
  backward costs the compute thread (`launch_ms`), at the profiled world size. The training steps
  alone cannot tell these apart from backward's own length (a longer backward slowed less replays
  the same), so backward's work is pinned to the backward the profiled run timed with nothing in
  flight (phases.json `compute_alone`, rank/profiler.py); for each s = s_c = s_m (fair share of the
  cores) the rest of the profiled backward is `launch_ms` per collective launched, and the s whose
  replay of the profiled run reproduces its measured backward, exposed comm and comm under backward
  best is kept. A profile without `compute_alone` (older runs) gets s_c and s_m from that replay
  alone, a pair the data cannot pin, and no launch cost (`identified_by` says which). Other world
  sizes scale them with a processor-sharing model of the cores (costs.slowdowns).

And `host`, timed by the profiled run's rank 0 with a rank's threads (phases.json, rank/host_timing.py):
copies into a used and a new buffer (flat's and fsdp's), adding into and zeroing a buffer (gradients as
bucket views), and PowerSGD's three phases on the profiled model's matrices. fit itself runs nothing of
torch's: every figure comes from the files.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import numpy as np

from ddp_lab.analysis.cost_model import fit_link
from ddp_lab.analysis.predict.costs import PredictError, ring_steps, tokens_per_rank
from ddp_lab.analysis.predict.schedule import job_step
from ddp_lab.analysis.records import collective_record, load_runs, task_of
from ddp_lab.arithmetic.bandwidth import bus_factor
from ddp_lab.arithmetic.intervals import intersect, merge, total
from ddp_lab.jobdir import PHASES, read_results
from ddp_lab.spec.figures import FWD_BWD, OPTIMIZER, SYNC

VERSION = 1


# --- collectives -----------------------------------------------------------------------------------

def fit_collectives(sweep_dir) -> dict:
    """{backend: {op: {dtype: {"by_world_size": {n: fit}, "ring": fit, "back_to_back": {...}}}}} from a
    task=allreduce sweep; `back_to_back` (the same two keys) fits the jobs timed without a barrier
    between calls (task.barrier=false), what blocking calls one after another cost."""
    runs = [res for _, res, _ in load_runs(sweep_dir) if task_of(res) == "allreduce" and res.get("status") == "ok"]
    rows = [{**collective_record(res), "network": ((res.get("config") or {}).get("network") or {}).get("name", "host")}
            for res in runs]
    rows = [r for r in rows if r.get("bytes") and r.get("latency_p50_ms")]
    if not rows:
        raise PredictError(f"no finished collective benchmark (task=allreduce) under {sweep_dir}")
    # a sweep of both implementations (backend.collectives=ring,native): fit what the strategies run by
    # default, the lab's rings on gloo, where there are any
    rings = {(r["backend"], r["op"]) for r in rows if r.get("collectives") == "ring"}
    rows = [r for r in rows if r.get("collectives") != "native" or (r["backend"], r["op"]) not in rings]
    groups: dict = {}
    for r in rows:
        key = (r["backend"], r["op"], r.get("dtype") or "fp32", r.get("barrier", True) is not False)
        groups.setdefault(key, []).append(r)
    out: dict = {}
    why = []
    for (backend, op, dtype, barrier), group in sorted(groups.items()):
        fitted = _fit_group(op, group, why)
        if not fitted["by_world_size"]:
            continue
        entry = out.setdefault(backend, {}).setdefault(op, {}).setdefault(dtype, {"by_world_size": {}})
        networks = sorted({r["network"] for r in group})
        fitted["network"] = networks[0] if len(networks) == 1 else "mixed"  # host: the cores set the pace
        implementations = sorted({r["collectives"] for r in group if r.get("collectives")})
        if implementations:  # reduce-scatter and all-gather: ring or native (backend.collectives)
            fitted["collectives"] = "/".join(implementations)
        if barrier:
            entry.update(fitted)
        else:
            entry["back_to_back"] = fitted
    if not out:
        raise PredictError(f"no collective in {sweep_dir} could be fitted (two or more message sizes at one world "
                           f"size, time growing with size): {'; '.join(why) or 'one size each'}")
    return out


def _fit_group(op: str, group: list[dict], why: list[str]) -> dict:
    """alpha-beta per world size and the ring form across them, for one op's jobs timed one way."""
    entry: dict = {"by_world_size": {}}
    for n in sorted({r["world_size"] for r in group}):
        pts = [r for r in group if r["world_size"] == n]
        if len({r["bytes"] for r in pts}) < 2:
            continue
        try:
            f = fit_link([r["bytes"] for r in pts], [r["latency_p50_ms"] / 1e3 for r in pts])
        except ValueError as exc:
            why.append(f"{op} at {n} ranks: {exc}")  # e.g. time does not grow with size: no bandwidth
            continue
        entry["by_world_size"][str(n)] = {"alpha_ms": f.overhead_s * 1e3, "beta_GBps": f.bandwidth_Bps / 1e9,
                                          "rel_rms": f.rel_rms, "sizes": f.n_points,
                                          "bytes": sorted({r["bytes"] for r in pts})}
    multi = [r for r in group if r["world_size"] > 1]
    if len({r["bytes"] for r in multi}) >= 2:
        entry["ring"] = _fit_ring(op, multi)
    return entry


def _fit_ring(op: str, rows: list[dict]) -> dict:
    """alpha per latency step and bus bandwidth across world sizes (relative least squares, >= 0)."""
    x = np.array([[ring_steps(op, r["world_size"]), bus_factor(op, r["world_size"]) * r["bytes"]] for r in rows], float)
    t = np.array([r["latency_p50_ms"] / 1e3 for r in rows])
    w = 1 / t
    (a, b), *_ = np.linalg.lstsq(x * w[:, None], t * w, rcond=None)
    if a < 0:
        a, b = 0.0, float(np.sum(w * w * x[:, 1] * t) / np.sum(w * w * x[:, 1] ** 2))
    b = max(b, 1e-15)
    rel = (t - x @ np.array([a, b])) / t
    return {"alpha_step_ms": a * 1e3, "busbw_GBps": 1 / b / 1e9, "rel_rms": float(np.sqrt(np.mean(rel ** 2))),
            "world_sizes": sorted({r["world_size"] for r in rows})}


# --- compute: the profiled run ----------------------------------------------------------------------

def _profiled_job(run_dir) -> Path:
    run_dir = Path(run_dir)
    found = sorted({p.parent for p in run_dir.rglob(PHASES)}) if run_dir.is_dir() else []
    if not found:
        raise PredictError(f"no profiled training run ({PHASES}; run with profile=true) under {run_dir}")
    if len(found) > 1:
        raise PredictError(f"{len(found)} profiled runs under {run_dir}; give one job folder")
    return found[0]


def _steps(phases: dict, warmup: int) -> list[list[dict]]:
    """Each step after warm-up as its ranks' records, preferring steps the torch profiler did not slow."""
    by_step: dict = {}
    for steps in phases["ranks"]:
        for s in steps:
            if s["step"] >= warmup:
                by_step.setdefault(s["step"], []).append(s)
    complete = [v for _, v in sorted(by_step.items()) if len(v) == len(phases["ranks"])]
    clean = [v for v in complete if not v[0]["profiled"]]
    chosen = clean if len(clean) >= 2 else complete
    if not chosen:
        raise PredictError("the profiled run has no step after warm-up")
    return chosen


def _work(t: float, start: float, comm: list, slowdown: float) -> float:
    """Compute work (ms alone) done between `start` and `t` when comm slowed it by `slowdown`."""
    busy = total(intersect([(start, t)], comm)) if t > start else 0.0
    return (t - start) - busy * (1 - 1 / slowdown)


def compute_profile(phases: dict, warmup: int, compute_slowdown: float, launch_ms: float = 0.0) -> dict:
    """Median over steps of forward, backward (work), optimizer and other ms, and each parameter's
    ready work (ms), less `launch_ms` per collective launched before it (`launches`: how many
    backward launched). A step is as slow as its slowest rank: forward, backward and the gradient
    ready times are the rank that ended backward last (its ranks' clocks share an origin: they start
    each step together, after the previous step's figures were gathered), the optimizer and the rest
    the slowest rank's."""
    rows = []
    for ranks in _steps(phases, warmup):
        s = max(ranks, key=lambda r: r["laps_ms"][FWD_BWD.key])
        f0, f1 = s["forward_ms"]
        laps = s["laps_ms"]
        bwd_end, sync_end = laps[FWD_BWD.key], laps[SYNC.key]
        comm = merge(s["comm_ms"])
        starts = [a for a, _ in s["comm_ms"] if f1 <= a <= bwd_end]  # launched from backward's hooks

        def work(t, f1=f1, comm=comm, starts=starts):  # a ready time is read after that hook's launch
            return max(0.0, _work(t, f1, comm, compute_slowdown) - launch_ms * sum(a <= t for a in starts))

        rows.append({
            "forward": f1 - f0, "backward": work(bwd_end), "launches": len(starts),
            "backward_wall": bwd_end - f1, "exposed": sync_end - bwd_end,
            "hidden": total(intersect([(f1, bwd_end)], comm)),
            "optimizer": max(r["laps_ms"][OPTIMIZER.key] - r["laps_ms"][SYNC.key] for r in ranks),
            "other": max(r["forward_ms"][0] + r["end_ms"] - r["laps_ms"][OPTIMIZER.key] for r in ranks),
            "step": max(r["end_ms"] for r in ranks),
            "ready": [None if t is None else work(t) for t in s["ready_ms"]]})
    med = {k: statistics.median(r[k] for r in rows) for k in
           ("forward", "backward", "launches", "backward_wall", "exposed", "hidden", "optimizer", "other", "step")}
    ready = []
    for i in range(len(phases["params"])):
        values = [r["ready"][i] for r in rows if r["ready"][i] is not None]
        ready.append(min(statistics.median(values), med["backward"]) if values else med["backward"])
    med["ready"] = ready
    med["samples"] = len(rows)
    return med


def fit_profile(run_dir, collectives: dict, host: dict | None = None) -> tuple[dict, dict]:
    """(compute, contention) from the profiled job under `run_dir` (see module docstring); `host`
    (fit's timings) lets the replay of the profiled strategy include its own host work."""
    job = _profiled_job(run_dir)
    phases = json.loads((job / PHASES).read_text())
    results = read_results(job) or {}
    cfg = results.get("config") or {}
    if not cfg:
        raise PredictError(f"{job} has no results.json with its config")
    backend = (results.get("env") or {}).get("backend") or "gloo"
    world_size = int(cfg["world_size"])
    warmup = int(cfg["train"]["warmup_steps"])
    cpus = float(phases.get("cpus") or os.cpu_count() or 1)
    threads = int(phases.get("threads_per_rank") or 1)
    base = {"job": str(job), "model": cfg["model"]["name"], "strategy": cfg["strategy"]["name"],
            "world_size": world_size, "backend": backend, "cpus": cpus, "threads_per_rank": threads,
            "tokens_per_rank": tokens_per_rank(cfg), "params": phases["params"],
            "precision": cfg["train"].get("precision", "fp32"),
            "grad_accum_steps": cfg["train"].get("grad_accum_steps", 1),
            "optimizer_params": sum(p["numel"] for p in phases["params"])}
    observed = compute_profile(phases, warmup, 1.0)
    scale = observed["backward_wall"]
    alone = backward_alone_ms(phases)

    def candidates():
        """(compute_slowdown, comm_slowdown, launch_ms) to try (module docstring)."""
        for compute_slowdown in np.arange(1.0, 3.001, 0.05):
            if alone is None:
                yield from ((compute_slowdown, comm, 0.0) for comm in np.arange(1.0, 6.001, 0.1))
                continue
            launches = observed["launches"]
            extra = compute_profile(phases, warmup, float(compute_slowdown))["backward"] - alone
            yield compute_slowdown, compute_slowdown, max(0.0, extra / launches) if launches else 0.0

    best = None
    for compute_slowdown, comm_slowdown, launch_ms in candidates():
        prof = compute_profile(phases, warmup, float(compute_slowdown), launch_ms)
        fields = _compute_fields(prof)
        ready = fields.pop("ready_ms")
        compute = {**base, **fields, "params": [{**p, "ready_ms": r} for p, r in zip(base["params"], ready)]}
        contention = {"u": float(compute_slowdown) - 1, "compute_slowdown": float(compute_slowdown),
                      "comm_slowdown": float(comm_slowdown), "launch_ms": launch_ms}
        model = {"collectives": collectives, "compute": compute, "contention": contention, "host": host or {}}
        replayed = job_step(model, cfg, backend)[1]
        err = sum(((a - b) / scale) ** 2 for a, b in ((replayed.backward_end_ms, observed["backward_wall"]),
                                                       (replayed.exposed_ms, observed["exposed"]),
                                                       (replayed.hidden_ms, observed["hidden"])))
        if best is None or err < best[0]:
            best = (err, compute, contention, replayed)
    _, compute, contention, replayed = best
    # what the phases do not explain: a step waits for its slowest rank, and the ranks' hiccups differ
    residual = max(0.0, observed["step"] - replayed.step_ms)
    compute["phases_other_ms"], compute["unexplained_ms"] = compute["other_ms"], residual
    compute["other_ms"] += residual
    contention["identified_by"] = (
        "compute_alone: backward's work pinned to the backward timed alone, the rest of its length split between "
        "launch_ms per collective and the slowdown (one factor for compute and comm: fair share of the cores)"
        if alone is not None else
        "replay only: no compute_alone in phases.json, compute and comm slowdowns trade off, launch_ms 0")
    contention["check"] = {
        "backward_wall_ms": {"measured": observed["backward_wall"], "replayed": replayed.backward_end_ms},
        "exposed_ms": {"measured": observed["exposed"], "replayed": replayed.exposed_ms},
        "comm_under_backward_ms": {"measured": observed["hidden"], "replayed": replayed.hidden_ms}}
    if alone is not None:
        contention["check"]["backward_work_ms"] = {"timed_alone": alone, "fitted": compute["backward_ms"]}
    return compute, contention


def backward_alone_ms(phases: dict) -> float | None:
    """Backward with no communication in flight (phases.json `compute_alone`), the statistic a step
    is measured by: each pass (every rank starts it together) as long as its slowest rank, then the
    median over passes. None if absent."""
    ranks = phases.get("compute_alone")
    if not ranks or not all(ranks):
        return None
    return statistics.median(max(r[i]["backward_ms"] for r in ranks) for i in range(min(len(r) for r in ranks)))


def _compute_fields(prof: dict) -> dict:
    return {"forward_ms": prof["forward"], "backward_ms": prof["backward"], "optimizer_ms": prof["optimizer"],
            "other_ms": prof["other"], "ready_ms": prof["ready"], "samples": prof["samples"],
            "measured_step_ms": prof["step"]}


def fit(collective_sweep, profiled_run) -> dict:
    collectives = fit_collectives(collective_sweep)
    phases = json.loads((_profiled_job(profiled_run) / PHASES).read_text())
    host = phases.get("host")
    if not host:
        raise PredictError(f"{profiled_run}: phases.json has no host timings (`host`, written by profile=true "
                           "runs of this version): profile again")
    compute, contention = fit_profile(profiled_run, collectives, host)
    return {"version": VERSION,
            "what": "ddp-lab step-time model: alpha-beta collectives, a profiled step as compute work, core sharing "
                    "(docs/predict.md)",
            "collectives": collectives, "compute": compute, "contention": contention, "host": host,
            "inputs": {"collective_sweep": str(collective_sweep), "profiled_run": str(profiled_run)}}


def save(model: dict, path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(model, indent=1))
    return path


def load(path) -> dict:
    path = Path(path)
    try:
        model = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PredictError(f"cannot read model file {path}: {exc}") from None
    if not isinstance(model, dict) or model.get("version") != VERSION or "compute" not in model:
        raise PredictError(f"{path} is not a model file written by `python -m ddp_lab.predict fit`")
    return model
