"""A training job's step on this machine, from the schedule its strategy's spec declares: the job's
`Work` (the profile's compute scaled to the job) and `FittedCosts` (the fitted collectives at its world
size and backend), interpreted by interpret.py. No strategy is named here.

Compute comes from the model's profile, scaled to the job: by the tokens each rank computes (the
global batch is split over ranks) and by the core share a rank's compute thread gets at the job's
world size (`fit.share_speeds`). Each collective is timed by the fitted alpha-beta of its op at the
job's world size; `blocking` calls by the fit of calls timed back to back where the sweep has one.
An all-gather or reduce-scatter is timed by its own op's fit (on gloo the lab's rings, as the sharded
strategies issue them under backend.collectives=auto); a sweep without those ops times it as N
broadcasts or reduces of 1/N (a reduce as a broadcast where the sweep has no reduce). Host copies into
new storage (flat's, fsdp's) are compute work at the host's copy bandwidth into new memory: on this
machine's glibc a freed buffer's pages go back to the OS and come back with a fault each. Where
gradients are bucket slices (`grads_in_buckets`), the zeroing and the adds are priced at the host's
rates, work the profiled overlap run (autograd keeping its own tensors) did not do. PowerSGD's phases
are timed by `rank/host_timing.powersgd_work` (phases.json `host`).

A strategy whose spec declares no schedule (`schedule()` is None) raises `PredictError` (validate
reports the job as not predicted).
"""

from __future__ import annotations

import functools

from ddp_lab.analysis.predict.costs import PredictError, collective_ms, share_speeds, slowdowns, tokens_per_rank
from ddp_lab.analysis.predict.interpret import Work, interpret, planned_units
from ddp_lab.analysis.predict.replay import Replayed, Step
from ddp_lab.spec.schedule import Schedule
from ddp_lab.spec.strategies import SPECS, SpecError, spec_of
from ddp_lab.units import ELEMENT_BYTES


def schedule_of(strategy: dict) -> Schedule:
    """The collective schedule a job's strategy config declares through its spec."""
    try:
        plan = spec_of(strategy).schedule()
    except SpecError as exc:
        raise PredictError(str(exc)) from None
    if plan is None:
        replayed = [name for name, cls in SPECS.items() if cls().schedule() is not None]
        raise PredictError(f"no replay for strategy {strategy.get('name')!r}: its spec declares no collective "
                           f"schedule (replayed: {', '.join(replayed)})")
    return plan


def job_step(model: dict, cfg: dict, backend: str | None = None) -> tuple[Step, Replayed]:
    """The step of the training job configured by `cfg` (a results.json config), and its replay."""
    plan = schedule_of(cfg["strategy"])
    costs = FittedCosts(model, cfg, backend)
    return interpret(plan, job_work(model, cfg, costs.core), costs)


def job_work(model: dict, cfg: dict, core: float) -> Work:
    """The job's rank before communication: the profile's parameters and compute, scaled by the tokens
    the job's rank computes and the core share `core` (the profiled rank's speed over this one's)."""
    prof = model["compute"]
    if cfg["model"]["name"] != prof["model"]:
        raise PredictError(f"the profile is of model {prof['model']!r}, the job trains {cfg['model']['name']!r}")
    for key, default in (("precision", "fp32"), ("grad_accum_steps", 1)):
        mine, profiled = cfg.get("train", {}).get(key, default), prof.get(key, default)
        if mine != profiled:
            raise PredictError(f"the profile ran train.{key}={profiled}, the job {mine}: profile one like it")
    scale = tokens_per_rank(cfg) / prof["tokens_per_rank"] * core
    wire = ELEMENT_BYTES[str(cfg["strategy"].get("comm_dtype") or "fp32")] / ELEMENT_BYTES["fp32"]
    params = prof["params"]
    return Work(params=params, wire=[p["bytes"] * wire for p in params],
                ready=[p["ready_ms"] * scale for p in params],  # backward work (ms) when each gradient is ready
                forward_ms=prof["forward_ms"] * scale, backward_ms=prof["backward_ms"] * scale,
                optimizer_ms=prof["optimizer_ms"] * core, other_ms=prof["other_ms"] * core,
                units=functools.partial(planned_units, cfg["model"], params),
                p50_plain=functools.partial(_mostly_uncompressed, cfg.get("train", {})))


class FittedCosts:
    """This machine's prices (interpret.Costs): the fitted collectives at the job's world size and backend,
    the host's copy rates and the core share at that world size, the contention between compute and
    communication (fit.py)."""

    def __init__(self, model: dict, cfg: dict, backend: str | None):
        prof, contention = model["compute"], model["contention"]
        self.model, self.prof = model, prof
        n = self.n = int(cfg["world_size"])
        self.backend = backend or prof["backend"]
        here = share_speeds(n, prof["cpus"], prof["threads_per_rank"], contention["u"])
        there = share_speeds(prof["world_size"], prof["cpus"], prof["threads_per_rank"], contention["u"])
        self.core = there["compute_alone"] / here["compute_alone"]
        self.compute_slowdown, self.comm_slowdown = slowdowns(contention, n, prof["world_size"], prof["cpus"],
                                                              prof["threads_per_rank"])
        self.dtype = str(cfg["strategy"].get("comm_dtype") or "fp32")
        self.launch_ms = contention.get("launch_ms", 0.0) * self.core

    def collective(self, op: str, nbytes: float, back_to_back: bool = False) -> float:
        return collective_ms(self.model["collectives"], self.backend, op, nbytes, self.n, self.dtype,
                             back_to_back, cpus=self.prof.get("cpus"))

    def _swept(self, op: str) -> str:
        """`op`, or broadcast where the sweep did not time it (a reduce moves a broadcast's bytes)."""
        return op if op in self.model["collectives"].get(self.backend, {}) else "broadcast"

    def sharded(self, op: str, nbytes: float) -> float:
        """Its own fit, else N broadcasts / reduces of 1/N (gloo's stand-in for a sharded collective, one
        call per rank)."""
        try:
            return self.collective(op, nbytes)
        except PredictError:
            return self.n * self.collective(self._swept("broadcast" if op == "all_gather" else "reduce"),
                                            nbytes / self.n)

    def host(self, op: str, nbytes: float) -> float:
        """`nbytes` through `op` (rank/host_timing.HOST_OPS) on a rank's compute thread. An op an older model
        file did not time: a copy's figure for a copy into a new buffer, nothing for the others."""
        host = self.model["host"]
        rate = host.get(f"{op}_GBps") or (host["copy_GBps"] if op == "fresh_copy" else None)
        return nbytes / rate / 1e6 * self.core if rate else 0.0

    def powersgd_work(self, phase: int, param: dict) -> float:
        work = self.model["host"].get("powersgd")
        if not work or not work["numel"]:
            raise PredictError("the replay of powersgd's compressed steps needs a model fitted by this version "
                               "from a profile with parameter shapes: fit again, profile again")
        return work["phase_ms"][phase - 1] * param["numel"] / work["numel"] * self.core


def _mostly_uncompressed(train: dict, start_iter: int) -> bool:
    """Whether most measured steps come before PowerSGD's `start_iter` (the p50 step is a plain one)."""
    measured = max(1, train.get("steps", 20) - train.get("warmup_steps", 3))
    plain = max(0, min(start_iter, train.get("steps", 20)) - train.get("warmup_steps", 3))
    return plain > measured / 2


def best_bucket_mb(model: dict, cfg: dict, candidates) -> tuple[float, dict]:
    """The candidate bucket size with the lowest predicted step, and every candidate's step (ms)."""
    steps = {}
    for mb in candidates:
        job = {**cfg, "strategy": {**cfg["strategy"], "bucket_mb": float(mb)}}
        steps[float(mb)] = job_step(model, job)[1].step_ms
    return min(steps, key=steps.get), steps
