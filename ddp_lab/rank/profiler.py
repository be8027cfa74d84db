"""profile=true: torch.profiler traces of a few training steps after warm-up, on every rank.

Kept out of the train loop, which only enters `StepProfiler` and calls `profiler.step()` once per
step. Each rank writes a Chrome/Perfetto trace to JOB/traces/rank{R}.json (open it in
https://ui.perfetto.dev or chrome://tracing). When the loop ends, rank 0 reads every rank's trace,
computes the overlap of communication with computation (`analysis.traces.analyze_run`: compute
during comm over comm, per rank, then the mean) for results.json's `summary.trace_overlap`, and
draws JOB/timeline.png with a compute and a comm lane per rank.

Profiled steps are slower (the profiler records every op), so a profiled run's step times are not
the numbers to compare: profile one run, measure another. On several nodes rank 0 sees only the
traces on its own file system unless the job folder is shared.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from ddp_lab.analysis.timeline import plot_timeline
from ddp_lab.analysis.traces import analyze_run, find_traces
from ddp_lab.jobdir import TIMELINE, TRACES, trace_file

PROFILED_STEPS = 3


def profile_schedule(steps: int, warmup_steps: int) -> dict:
    """Skip the run's warm-up steps, one profiler warm-up step when there is room, then up to
    PROFILED_STEPS active steps (validation guarantees at least one step after warm-up)."""
    remaining = max(1, steps - warmup_steps)
    warm = 1 if remaining >= 2 else 0
    return {"wait": warmup_steps, "warmup": warm, "active": min(PROFILED_STEPS, remaining - warm), "repeat": 1}


class StepProfiler:
    """`with StepProfiler(cfg, job_dir, device) as profiler: ... profiler.step()`; a no-op unless
    `cfg.profile`. After a profiled run, `overlap` holds rank 0's trace analysis (else None)."""

    def __init__(self, cfg, job_dir, device: torch.device, label: str = "run"):
        self.enabled = bool(cfg.profile)
        self.job_dir, self.label = Path(job_dir), label
        self.plan = profile_schedule(cfg.train.steps, cfg.train.warmup_steps)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._prof = profile(activities=activities, schedule=schedule(**self.plan),
                             on_trace_ready=self._export) if self.enabled else None
        self.overlap: dict | None = None

    def __enter__(self) -> "StepProfiler":
        if self._prof is not None:
            self._prof.__enter__()
        return self

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._prof is not None:
            self._prof.__exit__(exc_type, exc, tb)
            if exc_type is None:
                self.overlap = self._analyze()
        return False

    def _export(self, prof) -> None:
        path = self.job_dir / trace_file(dist.get_rank())
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))

    def _analyze(self) -> dict | None:
        """Rank 0, once every rank's trace is on disk: overlap figures and the timeline picture."""
        dist.barrier()
        if dist.get_rank() != 0:
            return None
        traces = find_traces(self.job_dir / TRACES)
        if not traces:
            return None
        first = self.plan["wait"] + self.plan["warmup"]
        stats = analyze_run(traces)
        stats["profiled_steps"] = list(range(first, first + self.plan["active"]))
        stats["traces"] = [str(Path(p).relative_to(self.job_dir)) for p in traces]
        steps = stats["profiled_steps"]
        plot_timeline({self.label: traces}, self.job_dir / TIMELINE,
                      title=f"Compute and communication per rank, profiled steps {steps[0]}-{steps[-1]}")
        return stats
