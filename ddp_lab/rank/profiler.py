"""profile=true: torch.profiler traces of a few training steps after warm-up, on every rank.

Kept out of the train loop, which only enters `StepProfiler` and calls `profiler.step()` once per
step. Each rank writes a Chrome/Perfetto trace to JOB/traces/rank{R}.json (open it in
https://ui.perfetto.dev or chrome://tracing). When the loop ends, rank 0 reads every rank's trace and
computes the overlap of communication with computation (`arithmetic.traces.analyze_run`: compute during
comm over comm, per rank, then the mean) for results.json's `summary.trace_overlap`. The picture of
it (JOB/timeline.png, a compute and a comm lane per rank) is drawn from those files by launch.py when
the job has ended (analysis/timeline.py): a rank records, it does not plot.

Profiled steps are slower (the profiler records every op), so a profiled run's step times are not
the numbers to compare: profile one run, measure another. On several nodes rank 0 sees only the
traces on its own file system unless the job folder is shared.

Beside the traces, a `GradientClock` (a forward hook and one post-accumulate-grad hook per
parameter, cheap enough for every step) records on every step of a profiled run when forward
started and ended, when each parameter's gradient was accumulated, the step's communication
intervals and its lap marks; rank 0 writes all ranks' records to JOB/phases.json. The step-time
predictor (`python -m ddp_lab.predict fit`) reads it, preferring steps the profiler did not record.

After the last step, `time_compute_alone` runs forward and backward of a fresh copy of the model with
no strategy on every rank at once: compute with no communication in flight. On shared cores a
collective in flight slows backward, and from the training steps alone that slowdown cannot be told
apart from backward's own length (a longer backward with no slowdown replays the same); phases.json's
`compute_alone` pins it. Rank 0 then times the host work the predictor needs and a step does not time
(rank/host_timing.py: copies, adds, zeroing, PowerSGD's phases on this model's matrices) into
phases.json's `host`, so `predict fit` reads every measurement from files.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from ddp_lab.arithmetic.traces import analyze_run, find_traces
from ddp_lab.jobdir import PHASES, TRACES, trace_file, write_json_atomic
from ddp_lab.rank.host_timing import host_timings
from ddp_lab.rank.process_group import synchronize

PROFILED_STEPS = 3
COMPUTE_ALONE_WARMUP, COMPUTE_ALONE_REPEATS = 2, 10


def profile_schedule(steps: int, warmup_steps: int) -> dict:
    """Skip the run's warm-up steps, one profiler warm-up step when there is room, then up to
    PROFILED_STEPS active steps (validation guarantees at least one step after warm-up)."""
    remaining = max(1, steps - warmup_steps)
    warm = 1 if remaining >= 2 else 0
    return {"wait": warmup_steps, "warmup": warm, "active": min(PROFILED_STEPS, remaining - warm), "repeat": 1}


class GradientClock:
    """When each phase of a step happened on this rank (perf_counter seconds, kept relative to the
    step's start): forward start and end, each trainable parameter's gradient accumulated (its
    post-accumulate-grad hook, registered after the strategy's, so after any launch it makes), the
    communication intervals the strategy recorded, and the timer's lap marks."""

    def __init__(self, module: torch.nn.Module):
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.params = [{"name": n, "numel": p.numel(), "bytes": p.numel() * p.element_size(),
                        "dtype": str(p.dtype).replace("torch.", ""), "shape": list(p.shape)} for n, p in named]
        self.steps: list[dict] = []
        self._forward: list[float] = []
        self._ready: list[float | None] = [None] * len(named)
        # kept out of torch.compile's graphs (train.compile of a whole model would break its graph at the clock)
        stamp = torch.compiler.disable(lambda *_: self._forward.append(time.perf_counter()))
        module.register_forward_pre_hook(stamp)
        module.register_forward_hook(stamp)
        for index, (_, p) in enumerate(named):
            p.register_post_accumulate_grad_hook(lambda _, i=index: self._mark_ready(i))

    def _mark_ready(self, index: int) -> None:
        self._ready[index] = time.perf_counter()

    def end_step(self, step: int, profiled: bool, timer, comm_intervals) -> None:
        """Call after the timer stopped and before the strategy's comm figures are popped."""
        t0 = timer.started
        rel = lambda t: None if t is None else (t - t0) * 1e3  # noqa: E731
        self.steps.append({"step": step, "profiled": profiled, "end_ms": rel(timer.stopped),
                           "forward_ms": [rel(t) for t in self._forward[-2:]],
                           "laps_ms": {k: rel(t) for k, t in timer.marks.items()},
                           "ready_ms": [rel(t) for t in self._ready],
                           "comm_ms": [[rel(a), rel(b)] for a, b in comm_intervals]})
        self._forward, self._ready = [], [None] * len(self.params)


class StepProfiler:
    """`with StepProfiler(cfg, job_dir, device) as profiler: ... profiler.step()`; a no-op unless
    `cfg.profile`. After a profiled run, `overlap` holds rank 0's trace analysis (else None)."""

    def __init__(self, cfg, job_dir, device: torch.device):
        self.enabled = bool(cfg.profile)
        self.job_dir = Path(job_dir)
        self.plan = profile_schedule(cfg.train.steps, cfg.train.warmup_steps)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._prof = profile(activities=activities, schedule=schedule(**self.plan),
                             on_trace_ready=self._export) if self.enabled else None
        self.overlap: dict | None = None
        self.clock: GradientClock | None = None
        self.compute_alone: list[dict] | None = None
        self.device = device
        self._step = 0

    def watch(self, module: torch.nn.Module) -> None:
        """Record phase times of `module` (the unwrapped model) on every step; a no-op unless profiling."""
        if self.enabled:
            self.clock = GradientClock(module)

    def records(self, step: int) -> bool:
        """Is `step` one the profiler traces (its warm-up or active steps)?"""
        first = self.plan["wait"]
        return self.enabled and first <= step < first + self.plan["warmup"] + self.plan["active"]

    def end_step(self, timer, comm_intervals) -> None:
        """After the step's timer stopped, before its comm figures are popped (see GradientClock)."""
        if self.clock is not None:
            first = self.plan["wait"] + self.plan["warmup"]
            self.clock.end_step(self._step, first <= self._step < first + self.plan["active"], timer,
                                comm_intervals)
        self._step += 1

    def time_compute_alone(self, make_model, batch, loss_fn, autocast) -> None:
        """Forward and backward of `make_model()` (a fresh, unwrapped copy) on `batch` (inputs,
        targets) under `autocast()`, COMPUTE_ALONE_REPEATS passes after COMPUTE_ALONE_WARMUP untimed
        ones, every rank starting each pass together (a barrier, outside the timing) as a training
        step starts; a no-op unless profiling."""
        if not self.enabled:
            return
        model, times = make_model(), []
        for _ in range(COMPUTE_ALONE_WARMUP + COMPUTE_ALONE_REPEATS):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            synchronize(self.device)
            start = time.perf_counter()
            with autocast():
                logits = model(batch[0])
            loss = loss_fn(logits.float(), batch[1])
            synchronize(self.device)
            forward_end = time.perf_counter()
            loss.backward()
            synchronize(self.device)
            end = time.perf_counter()
            times.append({"forward_ms": (forward_end - start) * 1e3, "backward_ms": (end - forward_end) * 1e3})
        self.compute_alone = times[COMPUTE_ALONE_WARMUP:]
        del model

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
        """Rank 0, once every rank's trace is on disk: phases.json (with the host timings) and the overlap
        figures."""
        dist.barrier()
        clocks = [None] * dist.get_world_size()
        mine = ({"params": self.clock.params, "steps": self.clock.steps, "compute_alone": self.compute_alone}
                if self.clock is not None else None)
        dist.all_gather_object(clocks, mine)
        if dist.get_rank() != 0:
            return None
        if all(c is not None for c in clocks):
            write_json_atomic(self.job_dir / PHASES, {
                "params": clocks[0]["params"], "profiled_steps": self.plan, "cpus": len(os.sched_getaffinity(0)),
                "threads_per_rank": torch.get_num_threads(),
                "ranks": [c["steps"] for c in clocks],
                "compute_alone": [c["compute_alone"] for c in clocks] if clocks[0]["compute_alone"] else None,
                "host": host_timings([p["shape"] for p in clocks[0]["params"]])})
        traces = find_traces(self.job_dir / TRACES)
        if not traces:
            return None
        first = self.plan["wait"] + self.plan["warmup"]
        stats = analyze_run(traces)
        stats["profiled_steps"] = list(range(first, first + self.plan["active"]))
        stats["traces"] = [str(Path(p).relative_to(self.job_dir)) for p in traces]
        return stats
