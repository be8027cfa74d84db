"""What one training job's step is made of, as a `replay.Step`, from the schedule its strategy's spec
declares (spec/schedule.py): no strategy is named here.

Compute comes from the model's profile, scaled to the job: by the tokens each rank computes (the
global batch is split over ranks) and by the core share a rank's compute thread gets at the job's
world size (`fit.share_speeds`); the optimizer by the fraction of parameters this rank updates
(`Schedule.update`). Each term of the schedule becomes collectives, each timed by the fitted
alpha-beta of its op at the job's world size:

- gradients per tensor, after backward: one all-reduce per gradient in order (reduce-scattered: one
  reduce to its owner); `blocking`: timed back to back where the sweep timed them so;
- gradients per tensor, when ready: one all-reduce per gradient, launched when it is ready, in
  reverse parameter order;
- gradients all at once: one all-reduce after backward;
- `host_copies`: the gradients copied into buffers allocated for them and back, as compute work after
  backward (flat's, and any strategy that flattens);
- gradients per bucket: one all-reduce per bucket (`plan_bucket_indices`), launched when the bucket is
  full; reduce-scattered: one reduce-scatter of it;
- low rank (PowerSGD): the bucket all-reduces while most measured steps come before `start_iter`;
  else per bucket the all-reduces of [plain, P's] and of the Q's, each phase's work timed by
  `rank/host_timing.powersgd_work` (phases.json `host`);
- parameters per tensor (broadcast, or all-gathered whole tensors): one broadcast per parameter
  after the update, from its owner;
- parameters per bucket, all-gathered: one all-gather per bucket after the update;
- parameters all-reduced every k steps: one all-reduce of the parameters after the update, in the
  p50 step (below);
- sharded units (ZeRO-3): fsdp's own unit plan (`fsdp_units`): each unit all-gathered before its
  forward (one ahead) and again before its backward, reduce-scattered after its backward (`_fsdp`).

Parameters averaged every k steps: the p50 step is the step without the averaging when k > 2, with it
at 1, their mean at 2.
An all-gather or reduce-scatter is timed by its own op's fit (on gloo the lab's rings, as fsdp and
zero2 issue them under backend.collectives=auto); a sweep without those ops times it as N broadcasts
or reduces of 1/N (a reduce as a broadcast where the sweep has no reduce). fsdp's and flat's host
copies into new storage are compute work at the host's copy bandwidth into new memory: on this
machine's glibc a freed buffer's pages go back to the OS and come back with a fault each.
Where gradients are bucket slices (`grads_in_buckets`), forward zeroes the buckets and backward adds
each gradient into its slice, work the profiled overlap run (autograd keeping its own tensors) did
not do.

A strategy whose spec declares no schedule (`schedule()` is None) raises `PredictError` (validate
reports the job as not predicted).
"""

from __future__ import annotations

import dataclasses
import functools

from ddp_lab.analysis.predict.costs import PredictError, collective_ms, share_speeds, slowdowns, tokens_per_rank
from ddp_lab.analysis.predict.replay import Collective, Replayed, Step, replay
from ddp_lab.spec.buckets import plan_bucket_indices
from ddp_lab.spec.schedule import GradientSync, ParameterSync, Schedule
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
    job = _Job(model, cfg, backend)
    plan, sync = job.plan, job.plan.gradients
    if sync is not None and sync.grads_in_buckets:  # the bucket zeroed before forward, each gradient added in
        job.add_into_buckets()
    updated = 1 / job.n if plan.update == "shard" else 1.0
    opt_comm, comms, forward = 0.0, [], None
    if plan.units is not None:
        units, root = fsdp_units(cfg, job.params, plan.units.policy)
        job.forward_ms, job.backward_ms, gathers, comms = _fsdp(
            units, root, job.params, job.forward_ms, job.backward_ms, job.ready, job.grad_bytes, job.sharded_ms,
            lambda nbytes: job.coll("all_reduce", nbytes).ms, plan.units.reshard_after_forward,
            lambda nbytes: job.host_ms("fresh_copy", nbytes))
        forward = replay(Step(0.0, job.forward_ms, gathers if job.n > 1 else [], compute_slowdown=job.compute_slowdown,
                              comm_slowdown=job.comm_slowdown, launch_ms=job.launch_ms))
    elif plan.low_rank is not None and not _mostly_uncompressed(cfg.get("train", {}), plan.low_rank.start_iter):
        comms = job.powersgd_collectives(sync, plan.low_rank.rank)
    elif sync is not None:
        comms = job.gradient_collectives(sync)
    if plan.parameters is not None:
        opt_comm = job.parameter_ms(plan.parameters, sync)
    prof, core = job.prof, job.core
    step = Step(forward_ms=job.forward_ms if forward is None else forward.backward_end_ms,
                backward_ms=job.backward_ms,
                collectives=comms if job.n > 1 else [c for c in comms if c.label.startswith("flatten")],
                optimizer_ms=prof["optimizer_ms"] * updated * core, optimizer_comm_ms=opt_comm,
                other_ms=prof["other_ms"] * core, compute_slowdown=job.compute_slowdown,
                comm_slowdown=job.comm_slowdown, launch_ms=job.launch_ms)
    replayed = replay(step)
    if forward is not None:  # ZeRO-3: the forward's waits for its gathers are exposed too
        replayed = dataclasses.replace(replayed, exposed_ms=replayed.exposed_ms + forward.stalled_ms,
                                       comm_ms=replayed.comm_ms + forward.comm_ms,
                                       hidden_ms=replayed.hidden_ms + forward.hidden_ms,
                                       stalled_ms=replayed.stalled_ms + forward.stalled_ms)
    return step, replayed


class _Job:
    """One training job as the replay sees it: the profile's compute scaled to the job (tokens per rank,
    the core share at its world size), its gradients on the wire, and the fitted collectives at its
    world size and backend. Each term of the schedule becomes collectives through its methods."""

    def __init__(self, model: dict, cfg: dict, backend: str | None):
        prof, contention = model["compute"], model["contention"]
        self.model, self.prof, self.plan = model, prof, schedule_of(cfg["strategy"])
        if cfg["model"]["name"] != prof["model"]:
            raise PredictError(f"the profile is of model {prof['model']!r}, the job trains {cfg['model']['name']!r}")
        for key, default in (("precision", "fp32"), ("grad_accum_steps", 1)):
            mine, profiled = cfg.get("train", {}).get(key, default), prof.get(key, default)
            if mine != profiled:
                raise PredictError(f"the profile ran train.{key}={profiled}, the job {mine}: profile one like it")
        n = self.n = int(cfg["world_size"])
        self.backend = backend or prof["backend"]
        here = share_speeds(n, prof["cpus"], prof["threads_per_rank"], contention["u"])
        there = share_speeds(prof["world_size"], prof["cpus"], prof["threads_per_rank"], contention["u"])
        self.core = core = there["compute_alone"] / here["compute_alone"]
        self.compute_slowdown, self.comm_slowdown = slowdowns(contention, n, prof["world_size"], prof["cpus"],
                                                              prof["threads_per_rank"])
        scale = tokens_per_rank(cfg) / prof["tokens_per_rank"] * core
        self.dtype = str(cfg["strategy"].get("comm_dtype") or "fp32")
        wire = ELEMENT_BYTES[self.dtype] / ELEMENT_BYTES["fp32"]
        self.params = prof["params"]
        self.grad_bytes = [p["bytes"] * wire for p in self.params]
        self.ready = [p["ready_ms"] * scale for p in self.params]  # backward work (ms) when each gradient is ready
        self.forward_ms, self.backward_ms = prof["forward_ms"] * scale, prof["backward_ms"] * scale
        self.launch_ms = contention.get("launch_ms", 0.0) * core

    def coll(self, op, nbytes, ready_ms=None, label="", back_to_back=False) -> Collective:
        return Collective(collective_ms(self.model["collectives"], self.backend, op, nbytes, self.n, self.dtype,
                                        back_to_back, cpus=self.prof.get("cpus")), ready_ms, label)

    def bucket_plan(self, bucket_mb):
        return plan_bucket_indices([p["bytes"] for p in self.params], [p["dtype"] for p in self.params], bucket_mb)

    def padded(self, bucket, multiple):
        """A bucket's bytes on the wire, its length rounded up to a multiple of `multiple` fp32 elements."""
        nbytes = sum(self.grad_bytes[i] for i in bucket)
        return -(-nbytes // (multiple * 4)) * multiple * 4 if multiple > 1 else nbytes

    def swept(self, op):
        """`op`, or broadcast where the sweep did not time it (a reduce moves a broadcast's bytes)."""
        return op if op in self.model["collectives"].get(self.backend, {}) else "broadcast"

    def sharded_ms(self, op, nbytes):
        """An all-gather / reduce-scatter of `nbytes` in all: its own fit, else N broadcasts / reduces of 1/N
        (gloo's stand-in for a sharded collective, one call per rank)."""
        try:
            return self.coll(op, nbytes).ms
        except PredictError:
            return self.n * self.coll(self.swept("broadcast" if op == "all_gather" else "reduce"), nbytes / self.n).ms

    def host_ms(self, op, nbytes):
        """`nbytes` through `op` (rank/host_timing.HOST_OPS: a copy into a used or a new buffer, an add, a
        zeroing) on a rank's compute thread. An op an older model file did not time: a copy's figure for a
        copy into a new buffer, nothing for the others."""
        host = self.model["host"]
        rate = host.get(f"{op}_GBps") or (host["copy_GBps"] if op == "fresh_copy" else None)
        return nbytes / rate / 1e6 * self.core if rate else 0.0

    def add_into_buckets(self) -> None:
        """Gradients that are bucket slices: forward zeroes the buckets, backward adds each gradient in."""
        self.forward_ms += self.host_ms("zero", sum(p["bytes"] for p in self.params))
        added, shifted = 0.0, list(self.ready)
        for i in sorted(range(len(self.params)), key=lambda i: self.ready[i]):
            added += self.host_ms("add", self.params[i]["bytes"])
            shifted[i] = self.ready[i] + added
        self.ready, self.backward_ms = shifted, self.backward_ms + added

    def gradient_collectives(self, sync: GradientSync) -> list[Collective]:
        """The collectives of `sync` (spec/schedule.py) on this job's gradients; with `host_copies`, the
        gradients' copy into buffers allocated for them and back, after backward."""
        out = self._gradient_collectives(sync)
        if sync.host_copies:
            total = sum(self.grad_bytes)
            out.append(Collective(self.host_ms("fresh_copy", total) + self.host_ms("copy", total), None,
                                  "flatten + unflatten copies"))
        return out

    def _gradient_collectives(self, sync: GradientSync) -> list[Collective]:
        params, grad_bytes, ready = self.params, self.grad_bytes, self.ready
        at = ready if sync.launch == "ready" else [None] * len(params)
        if sync.group == "tensor":  # reduce-scattered whole tensors: on gloo one reduce to each one's owner
            order = reversed(range(len(params))) if sync.launch == "ready" else range(len(params))
            op, prefix = (("all_reduce", "") if sync.op == "all_reduce" else (self.swept("reduce"), "reduce "))
            return [self.coll(op, grad_bytes[i], at[i], f"{prefix}{params[i]['name']}", back_to_back=sync.blocking)
                    for i in order]
        if sync.group == "all" and sync.op == "all_reduce":
            return [self.coll("all_reduce", sum(grad_bytes), None, "flat")]
        if sync.group == "bucket" and sync.op == "all_reduce":
            return [self.coll("all_reduce", self.padded(b, 1),
                              max(at[i] for i in b) if sync.launch == "ready" else None, f"bucket {b[0]}-{b[-1]}")
                    for b in self.bucket_plan(sync.bucket_mb)]
        if sync.group == "bucket" and sync.op == "reduce_scatter":
            return [Collective(self.sharded_ms("reduce_scatter", self.padded(b, self.n)),
                               max(ready[i] for i in b) if sync.launch == "ready" else None,
                               f"reduce-scatter {b[0]}-{b[-1]}") for b in self.bucket_plan(sync.bucket_mb)]
        raise PredictError(f"no replay for gradients sent {sync.op} per {sync.group}")

    def powersgd_collectives(self, sync: GradientSync, rank: int) -> list[Collective]:
        """PowerSGD's compressed steps (`_powersgd`), each phase's work from the host timings."""
        work = self.model["host"].get("powersgd")
        if not work or not work["numel"] or any("shape" not in p for p in self.params):
            raise PredictError("the replay of powersgd's compressed steps needs a model fitted by this version "
                               "from a profile with parameter shapes: fit again, profile again")

        def work_ms(phase, param):
            return work["phase_ms"][phase - 1] * param["numel"] / work["numel"] * self.core

        self.backward_ms, comms = _powersgd(self.params, self.bucket_plan(sync.bucket_mb), self.ready,
                                            self.backward_ms, rank, work_ms, functools.partial(self.coll, "all_reduce"))
        return comms

    def parameter_ms(self, sync: ParameterSync, buckets: GradientSync | None) -> float:
        """The optimizer's communication of `sync` after the update."""
        if self.n == 1:
            return 0.0
        if sync.group == "tensor" and sync.op in ("broadcast", "all_gather"):  # whole tensors from their owners
            return sum(self.coll("broadcast", p["bytes"]).ms for p in self.params)
        if sync.group == "bucket" and sync.op == "all_gather" and buckets is not None and buckets.bucket_mb:
            return sum(self.sharded_ms("all_gather", self.padded(b, self.n))
                       for b in self.bucket_plan(buckets.bucket_mb))
        if sync.group == "all" and sync.op == "all_reduce":
            share = 1.0 if sync.every == 1 else 0.5 if sync.every == 2 else 0.0  # of the averaging, in the p50 step
            return share * self.coll("all_reduce", sum(p["bytes"] for p in self.params)).ms
        raise PredictError(f"no replay for parameters shared by {sync.op} per {sync.group}")


def _mostly_uncompressed(train: dict, start_iter: int) -> bool:
    """Whether most measured steps come before PowerSGD's `start_iter` (the p50 step is a plain one)."""
    measured = max(1, train.get("steps", 20) - train.get("warmup_steps", 3))
    plain = max(0, min(start_iter, train.get("steps", 20)) - train.get("warmup_steps", 3))
    return plain > measured / 2


@dataclasses.dataclass(frozen=True)
class FsdpUnit:
    """One unit of fsdp's plan as the replay needs it: indices into the profile's parameters."""

    name: str
    sharded: tuple[int, ...]
    replicated: tuple[int, ...]
    weight: int                 # parameters a matmul multiplies by (not lookups): its share of the compute
    needed_in_backward: bool


def fsdp_units(cfg: dict, params: list[dict], policy: str = "linear_embedding") -> tuple[list[FsdpUnit],
                                                                                         FsdpUnit | None]:
    """fsdp's units in registration order (its forward order on the models here) and its root, taken
    from the strategy's own plan (`plan_units` under `policy`) of the job's model built on the meta
    device: no memory, no time."""
    from omegaconf import OmegaConf

    from ddp_lab.models.facts import meta_model
    from ddp_lab.spec.strategies.fsdp_units import plan_units

    try:
        plans = plan_units(meta_model(OmegaConf.create(cfg["model"])), policy)
    except Exception as exc:  # noqa: BLE001 - a config this version cannot build: say why, predict the rest
        raise PredictError(f"fsdp's unit plan of model {cfg['model'].get('name')!r}: {exc}") from None
    index = {p["name"]: i for i, p in enumerate(params)}
    missing = [p.name for plan in plans for p in plan.params if p.name not in index]
    if missing:
        raise PredictError(f"the profile has no parameter {missing[0]!r} of fsdp's plan: profile this model")
    units = [FsdpUnit(plan.name, tuple(index[p.name] for p in plan.params if p.sharded),
                      tuple(index[p.name] for p in plan.params if not p.sharded),
                      sum(params[index[p.name]]["numel"] for p in plan.params if not p.lookup_only),
                      plan.needed_in_backward) for plan in plans]
    root = units.pop() if plans[-1].module is None else None
    return units, root


def _fsdp(units, root, params, forward_ms, backward_ms, ready, grad_bytes, sharded_ms, all_reduce_ms, reshard,
          fresh_copy_ms):
    """(forward ms, backward ms, forward's gathers, backward's collectives) of fsdp
    (strategies/fsdp/wrapper.py) on its own unit plan:

    - forward: the root and the first unit gathered and waited for at 0; each unit's gather launched
      when the unit before it starts, waited for when it starts; each unit's forward is its share of
      the matmul parameters (a lookup's is nothing), the root's last.
    - backward: the last unit of the forward is kept; every other unit needed in backward (not a unit
      of embeddings only) is gathered again when the unit after it begins backward (when that one's
      last-but-one neighbour finished), waited for when its own begins; a unit's reduce-scatter (and
      the all-reduce of its replicated gradients) launches when its last gradient is ready; the first
      unit (its inputs need no gradient) and the root are reduced at the end of backward.

    Forward and backward grow by the host copies into storage the strategy allocates at each use: every
    gathered unit copied out into its full parameters, every gradient folded into a new buffer."""
    if not units:
        raise PredictError("fsdp's plan has no unit to shard")
    gathered = [sum(params[i]["bytes"] for i in u.sharded) for u in units]  # gathered in the master dtype
    root_gathered = sum(params[i]["bytes"] for i in root.sharded) if root else 0.0
    last = len(units) - 1
    again = [reshard and k < last and units[k].needed_in_backward and gathered[k] > 0 for k in range(len(units))]
    forward_copy = fresh_copy_ms(root_gathered + sum(gathered))
    backward_copy = fresh_copy_ms(sum(g for g, a in zip(gathered, again) if a) + sum(p["bytes"] for p in params))
    forward_ms, stretch = forward_ms + forward_copy, (backward_ms + backward_copy) / backward_ms
    backward_ms, ready = backward_ms * stretch, [r * stretch for r in ready]

    total = sum(u.weight for u in units) + (root.weight if root else 0)
    starts = [0.0]
    for u in units:
        starts.append(starts[-1] + forward_ms * u.weight / max(total, 1))
    gathers = [Collective(sharded_ms("all_gather", root_gathered), 0.0, "gather root", 0.0)] if root_gathered else []
    gathers += [Collective(sharded_ms("all_gather", gathered[0]), 0.0, f"gather {units[0].name}", 0.0)]
    gathers += [Collective(sharded_ms("all_gather", gathered[k + 1]), starts[k], f"gather {units[k + 1].name}",
                           starts[k + 1]) for k in range(last)]

    def reductions(unit, at):
        out = []
        sharded, replicated = sum(grad_bytes[i] for i in unit.sharded), sum(grad_bytes[i] for i in unit.replicated)
        if sharded:
            out.append(Collective(sharded_ms("reduce_scatter", sharded), at, f"reduce-scatter {unit.name or 'root'}"))
        if replicated:
            out.append(Collective(all_reduce_ms(replicated), at, f"all-reduce {unit.name or 'root'}'s replicated"))
        return out

    ends = [max((ready[i] for i in u.sharded + u.replicated), default=0.0) for u in units]
    begins = [ends[k + 1] if k < last else 0.0 for k in range(len(units))]  # a unit's backward begins
    comms = []
    for k in range(last, -1, -1):
        if k >= 1 and again[k - 1]:  # launched as unit k begins its backward, waited for as unit k-1 begins
            comms.append(Collective(sharded_ms("all_gather", gathered[k - 1]), begins[k],
                                    f"gather {units[k - 1].name} again", begins[k - 1]))
        comms += reductions(units[k], ends[k] if k > 0 else backward_ms)
    if root is not None:
        comms += reductions(root, backward_ms)
    comms.sort(key=lambda c: c.ready_ms)  # stable: at a unit boundary the reduction, then the next gather
    return forward_ms, backward_ms, gathers, comms


def _powersgd(params, buckets, ready, backward_ms, rank, work_ms, all_reduce):
    """(backward ms, collectives) of a PowerSGD compressed step (strategies/powersgd.py): per bucket, in
    its hook, phase 1's work then the all-reduce of [plain tensors, P's]; in the next bucket's hook,
    after its own phase 1 and launch, a wait for that P (a gate), phase 2's work and the all-reduce of
    the Q's; after backward the last bucket's phase 2 and Q's and every bucket's phase 3 (on the queue
    behind the collectives they wait for, as flat's copies are). A bucket with nothing to compress is
    one plain all-reduce."""
    plans = []
    for b in buckets:
        matrices, plain = [], 0
        for i in b:
            shape = params[i]["shape"]
            n, m = (shape[0], params[i]["numel"] // shape[0]) if len(shape) >= 2 else (0, 0)
            r = min(rank, n, m)
            if len(shape) >= 2 and n * m > (n + m) * r:
                matrices.append((n, m, r, params[i]))
            else:
                plain += params[i]["numel"]
        size = params[b[0]]["bytes"] / params[b[0]]["numel"]
        if not matrices:
            plans.append({"send": sum(params[i]["bytes"] for i in b), "q": None})
            continue
        plans.append({"send": (plain + sum(n * r for n, _, r, _ in matrices)) * size,
                      "q": sum(m * r for _, m, r, _ in matrices) * size,
                      "work": [sum(work_ms(k, param) for *_, param in matrices) for k in (1, 2, 3)]})
    comms, shift, previous = [], 0.0, None
    for b, plan in zip(buckets, plans):
        compressed = plan["q"] is not None
        launched = max(ready[i] for i in b) + shift + (plan["work"][0] if compressed else 0.0)
        shift = launched - max(ready[i] for i in b)
        mine = len(comms)
        comms.append(all_reduce(plan["send"], launched, f"{'P' if compressed else 'bucket'} {b[0]}-{b[-1]}"))
        if previous is not None:  # the previous bucket's phase 2 runs in this hook, once its P is summed
            index, before = previous
            comms[index] = dataclasses.replace(comms[index], needed_ms=launched)
            shift += before["work"][1]
            comms.append(all_reduce(before["q"], launched + before["work"][1], "Q"))
        previous = (mine, plan) if compressed else None
    if previous is not None:  # the last compressed bucket's phase 2, after backward
        comms.append(Collective(previous[1]["work"][1], None, "phase 2 work", arithmetic=True))
        comms.append(all_reduce(previous[1]["q"], None, "Q"))
    phase3 = sum(plan["work"][2] for plan in plans if plan["q"] is not None)
    if phase3:
        comms.append(Collective(phase3, None, "phase 3 work", arithmetic=True))
    return backward_ms + shift, comms


def best_bucket_mb(model: dict, cfg: dict, candidates) -> tuple[float, dict]:
    """The candidate bucket size with the lowest predicted step, and every candidate's step (ms)."""
    steps = {}
    for mb in candidates:
        job = {**cfg, "strategy": {**cfg["strategy"], "bucket_mb": float(mb)}}
        steps[float(mb)] = job_step(model, job)[1].step_ms
    return min(steps, key=steps.get), steps
