"""How much communication hid behind computation, read from torch.profiler Chrome traces.

Overlap = (compute time during communication) / (communication time), per rank, with interval
unions so nested and concurrent events are never double counted. This is Holistic Trace
Analysis' comm-compute overlap, and the design's `1 - exposed / total` from the trace side.

What counts as what (torch 2.13 trace format, checked by tests/test_trace_analysis.py):

- CPU-only traces (gloo): communication is `c10d::*` ops (the call on the training thread,
  e.g. `c10d::allreduce_`) and `gloo:*` annotations (the collective running on gloo's own
  `pt_gloo_runloop` thread, including waiting for peers); compute is every other `cpu_op` on
  any thread. User annotations (`ProfilerStep#N`, `Optimizer.step#...`) and Python stack events
  span everything and are skipped. A thread inside a c10d call is not computing, so each thread's
  compute has its own comm subtracted (a DDP hook launches its all-reduce from inside the
  `AccumulateGrad` op that would otherwise cover it).
- Traces with GPU kernels (nccl): only device activity counts: kernels whose name contains
  `nccl` are communication, all other kernels compute (memcpy/memset are neither). Host-side ops
  are launches, not work.

Limits: the gloo annotation covers the collective's execution on gloo's thread, not time it sat
queued; timestamps of different ranks are comparable only on one host (same monotonic clock).
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ddp_lab.arithmetic.intervals import Interval, intersect, merge, subtract, total
from ddp_lab.jobdir import MERGED_TRACE

COMM_PATTERN = re.compile(r"nccl|^gloo:|^c10d::|record_param_comms", re.IGNORECASE)
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}


# --- traces ------------------------------------------------------------------------------------

def load_trace(path) -> dict:
    """A Chrome trace as a dict with `traceEvents` (plain or .gz; a bare event list is wrapped)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return {"traceEvents": data} if isinstance(data, list) else data


def trace_rank(trace: dict, default: int | None = None) -> int | None:
    """The rank torch.profiler recorded in `distributedInfo` (present when a process group exists)."""
    info = trace.get("distributedInfo") or {}
    return info.get("rank", default)


def is_device_trace(trace: dict) -> bool:
    return any(e.get("cat") == "kernel" for e in trace.get("traceEvents", []))


def classify_event(event: dict, device: bool = False) -> str | None:
    """'comm', 'compute' or None (not work: metadata, annotations, launches on a GPU trace)."""
    if event.get("ph") != "X" or not event.get("dur"):
        return None
    cat, name = event.get("cat", ""), str(event.get("name", ""))
    if device:
        if cat != "kernel":
            return None
        return "comm" if "nccl" in name.lower() else "compute"
    if cat in DEVICE_CATEGORIES:
        return None
    if cat in ("cpu_op", "user_annotation") and COMM_PATTERN.search(name):
        return "comm"
    if cat == "cpu_op":
        return "compute"
    return None


@dataclass
class Lanes:
    """One rank's merged compute and communication intervals (trace microseconds)."""

    rank: int | None
    compute: list[Interval]
    comm: list[Interval]
    steps: list[Interval] = field(default_factory=list)   # ProfilerStep#N spans, for drawing
    mode: str = "host"

    @property
    def start(self) -> float:
        spans = self.compute + self.comm + self.steps
        return min(s for s, _ in spans) if spans else 0.0

    @property
    def end(self) -> float:
        spans = self.compute + self.comm + self.steps
        return max(e for _, e in spans) if spans else 0.0


def lanes(trace: dict, rank: int | None = None) -> Lanes:
    """Classify a trace's events into compute and communication lanes (see module docstring)."""
    device = is_device_trace(trace)
    compute_by_thread: dict = {}
    comm_by_thread: dict = {}
    steps = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and str(ev.get("name", "")).startswith("ProfilerStep#"):
            steps.append((float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])))
        kind = classify_event(ev, device)
        if kind is None:
            continue
        span = (float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]))
        key = (ev.get("pid"), ev.get("tid"))
        (comm_by_thread if kind == "comm" else compute_by_thread).setdefault(key, []).append(span)
    compute = []
    for key, spans in compute_by_thread.items():
        # A thread inside a collective call is not computing (device streams never nest: no-op).
        compute += subtract(spans, comm_by_thread.get(key, []))
    comm = [s for spans in comm_by_thread.values() for s in spans]
    return Lanes(rank=trace_rank(trace, rank), compute=merge(compute), comm=merge(comm),
                 steps=merge(steps), mode="device" if device else "host")


def overlap_stats(trace_or_lanes) -> dict:
    """comm, compute and compute-during-comm time (ms) and overlap_pct for one rank.

    overlap_pct is None when the trace holds no communication (nothing to overlap).
    """
    ln = trace_or_lanes if isinstance(trace_or_lanes, Lanes) else lanes(trace_or_lanes)
    comm_us, compute_us = total(ln.comm), total(ln.compute)
    both_us = total(intersect(ln.compute, ln.comm))
    return {"rank": ln.rank, "mode": ln.mode, "comm_ms": comm_us / 1e3, "compute_ms": compute_us / 1e3,
            "overlap_ms": both_us / 1e3,
            "overlap_pct": 100.0 * both_us / comm_us if comm_us > 0 else None}


def _sniff(path: Path) -> tuple[bool, int | None]:
    """(is a Chrome trace, its rank) from the file's head: no need to parse a large trace twice."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            head = f.read(65536)
    except (OSError, UnicodeDecodeError):
        return False, None
    if '"traceEvents"' not in head:
        return False, None
    m = re.search(r'"distributedInfo"\s*:\s*\{[^}]*?"rank"\s*:\s*(\d+)', head)
    return True, int(m.group(1)) if m else None


def find_traces(run_dir) -> list[Path]:
    """Chrome trace files in a job folder (any `*.json` / `*.json.gz` with `traceEvents`), by rank."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        return [run_dir]
    found = []
    for path in sorted(run_dir.rglob("*.json")) + sorted(run_dir.rglob("*.json.gz")):
        if path.name == MERGED_TRACE:  # every rank's events in one file: not one rank's trace
            continue
        is_trace, rank = _sniff(path)
        if is_trace:
            found.append((rank, path))
    return [p for _, p in sorted(found, key=lambda rp: (rp[0] is None, rp[0] or 0, str(rp[1])))]


def analyze_run(traces) -> dict:
    """Overlap of a whole run: per-rank figures and their mean (what results.json records).

    `traces` are paths, loaded trace dicts or `Lanes`, one per rank.
    """
    per_rank = []
    for i, tr in enumerate(traces):
        if not isinstance(tr, Lanes):
            tr = lanes(tr if isinstance(tr, dict) else load_trace(tr), rank=i)
        per_rank.append(overlap_stats(tr))
    pcts = [r["overlap_pct"] for r in per_rank if r["overlap_pct"] is not None]
    mean = lambda key: sum(r[key] for r in per_rank) / len(per_rank) if per_rank else None  # noqa: E731
    return {"overlap_pct": sum(pcts) / len(pcts) if pcts else None,
            "comm_ms": mean("comm_ms"), "compute_ms": mean("compute_ms"), "overlap_ms": mean("overlap_ms"),
            "ranks": per_rank}


def merge_traces(paths, out) -> Path:
    """One Chrome trace of every rank's (`paths`, rank order) for Perfetto or chrome://tracing: a process per
    rank and original process ("rank 1: python"), on one time axis. Each torch.profiler trace counts its `ts`
    (µs) from its own `baseTimeNanoseconds`; here from the earliest event of all, so the ranks' skew shows
    as it was (one host's clock: the ranks of one machine)."""
    traces = [load_trace(p) for p in paths]
    bases = [t.get("baseTimeNanoseconds", 0) // 1000 for t in traces]  # µs, as integers: no float rounding
    start = min(base + min((e["ts"] for e in t["traceEvents"] if "ts" in e), default=0)
                for base, t in zip(bases, traces))
    events = []
    for i, (trace, base) in enumerate(zip(traces, bases)):
        rank = trace_rank(trace, i)
        pids: dict = {}
        for event in trace["traceEvents"]:
            event = dict(event)
            if "pid" in event:
                event["pid"] = pids.setdefault(event["pid"], 1000 * rank + len(pids))
            if "ts" in event:
                event["ts"] = event["ts"] + base - start
            if "id" in event and isinstance(event["id"], int):  # flow arrows stay within their rank
                event["id"] += rank << 40
            if event.get("ph") == "M" and event.get("name") == "process_name":
                event["args"] = {"name": f"rank {rank}: {(event.get('args') or {}).get('name', '')}"}
            elif event.get("ph") == "M" and event.get("name") == "process_sort_index":
                event["args"] = {"sort_index": event["pid"]}
            events.append(event)
    out = Path(out)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out
