"""The one interpreter of a strategy's schedule (spec/schedule.py): each term of the schedule becomes
compute and collectives on one rank's `Work`, timed by a `Costs`, and replayed (replay.py). No strategy
is named here.

Two cost models stand behind it: this machine's fitted one (schedule.py's `FittedCosts`: the alpha-beta
of each op at the job's world size, the host's copy rates, the core share) and a GPU system's NCCL model
(scale.py's `NcclCosts`, or torch's estimator). What differs between the two is a price, never the
schedule: a new term is one edit here.

The terms:

- gradients per tensor, after backward: one all-reduce per gradient in order; `blocking`: timed back
  to back where the cost model has such a fit; per tensor, when ready: one all-reduce per gradient
  launched when it is ready, in reverse parameter order; reduce-scattered whole tensors (each to its
  owner): one reduce-scatter of all of them after backward (zero1's flat buffer of owners' rows);
- gradients all at once: one all-reduce after backward;
- `host_copies`: the gradients copied into a buffer allocated for them and back, after backward;
- gradients per bucket (`plan_bucket_indices`, with torch DDP's smaller first bucket where asked): one
  all-reduce per bucket, launched when the bucket is full; reduce-scattered: one reduce-scatter of the
  bucket padded to a multiple of N elements;
- `grads_in_buckets`: forward zeroes the buckets and backward adds each gradient into its slice;
- low rank (PowerSGD): the bucket all-reduces while most measured steps come before `start_iter`;
  else per bucket the all-reduces of [plain, P's] and of the Q's, each phase's work priced by the
  cost model (`_powersgd`);
- parameters per tensor: one broadcast per parameter from its owner, one after another; all-gathered
  whole tensors: one all-gather of every owner's tensors (zero1's flat buffer); per bucket: one
  all-gather per bucket, padded; all-reduced every k steps: one all-reduce of the parameters, in the
  p50 step (below);
- sharded units (ZeRO-3): fsdp's own unit plan, or a described model's units (`_fsdp`).

Parameters averaged every k steps: the p50 step is the step without the averaging when k > 2, with it
at 1, their mean at 2. The optimizer runs on the fraction of parameters this rank updates
(`Schedule.update`). At one rank no collective runs; host copies still do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Protocol

from ddp_lab.analysis.predict.costs import PredictError
from ddp_lab.analysis.predict.replay import Collective, Replayed, Step, replay
from ddp_lab.arithmetic.buckets import plan_bucket_indices
from ddp_lab.spec.schedule import GradientSync, ParameterSync, Schedule


class Costs(Protocol):
    """What each piece of a step costs on one cost model (ms). `collective` is one call alone at the job's
    world size `n`; `sharded` an all-gather or reduce-scatter of `nbytes` in all; `host` `nbytes` through a
    host op (copy, fresh_copy: into new memory, zero, add) on the compute thread; `powersgd_work` a
    PowerSGD phase's work on one parameter."""

    n: int
    compute_slowdown: float
    comm_slowdown: float
    launch_ms: float

    def collective(self, op: str, nbytes: float, back_to_back: bool = False) -> float: ...

    def sharded(self, op: str, nbytes: float) -> float: ...

    def host(self, op: str, nbytes: float) -> float: ...

    def powersgd_work(self, phase: int, param: dict) -> float: ...


@dataclass(frozen=True)
class FsdpUnit:
    """One unit of fsdp's plan as the replay needs it: indices into the work's parameters."""

    name: str
    sharded: tuple[int, ...]
    replicated: tuple[int, ...]
    weight: float               # its share of the forward compute (matmul parameters, not lookups)
    needed_in_backward: bool


@dataclass
class Work:
    """One rank's step before any communication: the parameters in registration order (`name`, `numel`,
    `bytes` in the dtype they are gathered in, `dtype`; `shape` where known), each gradient's bytes on the
    wire and the backward work (ms) after which it is ready, the compute (ms, one rank alone; the optimizer
    for every parameter), and how to get fsdp's units under a policy: (units, root or None)."""

    params: list[dict]
    wire: list[float]
    ready: list[float]
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    other_ms: float = 0.0
    units: Callable[[str], tuple[list[FsdpUnit], FsdpUnit | None]] | None = None
    first_bucket_mb: float | None = None   # torch DDP's smaller first bucket (the last gradients)
    p50_plain: Callable[[int], bool] = field(default=lambda start_iter: False)
    """Whether the p50 step comes before PowerSGD's `start_iter` (a plain, uncompressed step)."""


def interpret(plan: Schedule, work: Work, costs: Costs) -> tuple[Step, Replayed]:
    """The step `plan` makes of `work` on `costs`, and its replay."""
    return _Interpreter(plan, work, costs).step()


class _Interpreter:
    def __init__(self, plan: Schedule, work: Work, costs: Costs):
        self.plan, self.costs, self.n = plan, costs, costs.n
        self.params, self.wire, self.ready = work.params, work.wire, list(work.ready)
        self.work = work
        self.forward_ms, self.backward_ms = work.forward_ms, work.backward_ms

    def coll(self, op, nbytes, ready_ms=None, label="", back_to_back=False) -> Collective:
        return Collective(self.costs.collective(op, nbytes, back_to_back), ready_ms, label)

    def step(self) -> tuple[Step, Replayed]:
        plan, sync, n = self.plan, self.plan.gradients, self.n
        if sync is not None and sync.grads_in_buckets:
            self.add_into_buckets()
        comms, copies, forward = [], [], None
        if plan.units is not None:
            comms, forward = self.sharded_units()
        elif plan.low_rank is not None and not self.work.p50_plain(plan.low_rank.start_iter):
            comms = self.powersgd_collectives(sync, plan.low_rank.rank)
        elif sync is not None:
            comms, copies = self.gradient_collectives(sync), self.host_copies(sync)
        opt_comm = self.parameter_ms(plan.parameters, sync) if plan.parameters is not None and n > 1 else 0.0
        updated = 1 / n if plan.update == "shard" else 1.0
        step = Step(forward_ms=self.forward_ms if forward is None else forward.backward_end_ms,
                    backward_ms=self.backward_ms, collectives=(comms if n > 1 else []) + copies,
                    optimizer_ms=self.work.optimizer_ms * updated, optimizer_comm_ms=opt_comm,
                    other_ms=self.work.other_ms, compute_slowdown=self.costs.compute_slowdown,
                    comm_slowdown=self.costs.comm_slowdown, launch_ms=self.costs.launch_ms)
        replayed = replay(step)
        if forward is not None:  # ZeRO-3: the forward's waits for its gathers are exposed too
            replayed = dataclasses.replace(replayed, exposed_ms=replayed.exposed_ms + forward.stalled_ms,
                                           comm_ms=replayed.comm_ms + forward.comm_ms,
                                           hidden_ms=replayed.hidden_ms + forward.hidden_ms,
                                           stalled_ms=replayed.stalled_ms + forward.stalled_ms)
        return step, replayed

    # --- gradients ----------------------------------------------------------------------------------

    def add_into_buckets(self) -> None:
        """Gradients that are bucket slices: forward zeroes the buckets, backward adds each gradient in."""
        host = self.costs.host
        self.forward_ms += host("zero", sum(p["bytes"] for p in self.params))
        added, shifted = 0.0, list(self.ready)
        for i in sorted(range(len(self.params)), key=lambda i: self.ready[i]):
            added += host("add", self.params[i]["bytes"])
            shifted[i] = self.ready[i] + added
        self.ready, self.backward_ms = shifted, self.backward_ms + added

    def bucket_plan(self, bucket_mb: float) -> list[list[int]]:
        nbytes, dtypes = [p["bytes"] for p in self.params], [p["dtype"] for p in self.params]
        buckets = plan_bucket_indices(nbytes, dtypes, bucket_mb)
        first_mb = self.work.first_bucket_mb
        if first_mb is None or not buckets:
            return buckets
        first = plan_bucket_indices(nbytes, dtypes, first_mb)[0]  # DDP: the last gradients, a smaller bucket
        rest = [i for i in range(len(nbytes)) if i not in set(first)]
        return [first] + ([[rest[j] for j in b] for b in plan_bucket_indices(
            [nbytes[i] for i in rest], [dtypes[i] for i in rest], bucket_mb)] if rest else [])

    def padded(self, indices, multiple: int) -> float:
        """Gradients' bytes on the wire, the length rounded up to a multiple of `multiple` fp32 elements."""
        nbytes = sum(self.wire[i] for i in indices)
        return -(-nbytes // (multiple * 4)) * multiple * 4 if multiple > 1 else nbytes

    def host_copies(self, sync: GradientSync) -> list[Collective]:
        """With `host_copies`: the gradients copied into a buffer allocated for them and back, after backward."""
        if not sync.host_copies:
            return []
        total = sum(self.wire)
        return [Collective(self.costs.host("fresh_copy", total) + self.costs.host("copy", total), None,
                           "flatten + unflatten copies")]

    def gradient_collectives(self, sync: GradientSync) -> list[Collective]:
        """The collectives of `sync` (spec/schedule.py) on this rank's gradients."""
        wire, ready, everything = self.wire, self.ready, range(len(self.params))
        at = ready if sync.launch == "ready" else [None] * len(self.params)
        if sync.group == "tensor" and sync.op == "reduce_scatter":  # whole tensors to their owners, one call
            return [Collective(self.costs.sharded("reduce_scatter", self.padded(everything, self.n)), None,
                               "reduce-scatter to owners")]
        if sync.group == "tensor":
            order = reversed(everything) if sync.launch == "ready" else everything
            return [self.coll("all_reduce", wire[i], at[i], self.params[i]["name"], back_to_back=sync.blocking)
                    for i in order]
        if sync.group == "all" and sync.op == "all_reduce":
            return [self.coll("all_reduce", sum(wire), None, "flat")]
        if sync.group == "bucket":
            buckets = self.bucket_plan(sync.bucket_mb)
            launch = [max(ready[i] for i in b) if sync.launch == "ready" else None for b in buckets]
            if sync.op == "all_reduce":
                return [self.coll("all_reduce", self.padded(b, 1), t, f"bucket {b[0]}-{b[-1]}")
                        for b, t in zip(buckets, launch)]
            return [Collective(self.costs.sharded("reduce_scatter", self.padded(b, self.n)), t,
                               f"reduce-scatter {b[0]}-{b[-1]}") for b, t in zip(buckets, launch)]
        raise PredictError(f"no replay for gradients sent {sync.op} per {sync.group}")

    def powersgd_collectives(self, sync: GradientSync, rank: int) -> list[Collective]:
        """PowerSGD's compressed steps (`_powersgd`), each phase's work priced by the cost model."""
        if any("shape" not in p for p in self.params):
            raise PredictError("the replay of powersgd's compressed steps needs parameter shapes: profile again")
        self.backward_ms, comms = _powersgd(self.params, self.bucket_plan(sync.bucket_mb), self.ready,
                                            self.backward_ms, rank, self.costs.powersgd_work,
                                            lambda nbytes, at, label: self.coll("all_reduce", nbytes, at, label))
        return comms

    # --- parameters ---------------------------------------------------------------------------------

    def parameter_ms(self, sync: ParameterSync, buckets: GradientSync | None) -> float:
        """The optimizer's communication of `sync` after the update."""
        nbytes = [p["bytes"] for p in self.params]
        if sync.group == "tensor" and sync.op == "broadcast":  # each tensor from its owner, one after another
            return sum(self.costs.collective("broadcast", b) for b in nbytes)
        if sync.group == "tensor" and sync.op == "all_gather":  # every owner's tensors, one call
            return self.costs.sharded("all_gather", sum(nbytes))
        if sync.group == "bucket" and sync.op == "all_gather" and buckets is not None and buckets.bucket_mb:
            return sum(self.costs.sharded("all_gather", self.padded(b, self.n))
                       for b in self.bucket_plan(buckets.bucket_mb))
        if sync.group == "all" and sync.op == "all_reduce":
            share = 1.0 if sync.every == 1 else 0.5 if sync.every == 2 else 0.0  # of the averaging, in the p50 step
            return share * self.costs.collective("all_reduce", sum(nbytes))
        raise PredictError(f"no replay for parameters shared by {sync.op} per {sync.group}")

    # --- sharded units ------------------------------------------------------------------------------

    def sharded_units(self) -> tuple[list[Collective], Replayed]:
        """Backward's collectives and the forward's replay of fsdp's units (`_fsdp`)."""
        if self.work.units is None:
            raise PredictError("this model has no unit plan to shard")
        units, root = self.work.units(self.plan.units.policy)
        host = self.costs.host
        self.forward_ms, self.backward_ms, gathers, comms = _fsdp(
            units, root, self.params, self.forward_ms, self.backward_ms, self.ready, self.wire,
            self.costs.sharded, lambda nbytes: self.costs.collective("all_reduce", nbytes),
            self.plan.units.reshard_after_forward, lambda nbytes: host("fresh_copy", nbytes))
        forward = replay(Step(0.0, self.forward_ms, gathers if self.n > 1 else [],
                              compute_slowdown=self.costs.compute_slowdown, comm_slowdown=self.costs.comm_slowdown,
                              launch_ms=self.costs.launch_ms))
        return comms, forward


def units_by_name(params: list[dict]) -> tuple[list[FsdpUnit], None]:
    """A described model's units (its parameters' `unit`, in order of first appearance), every parameter
    sharded, no root: a unit's forward share is its backward work, and one with none (lookups only) is
    not gathered again for backward."""
    order: dict[str, list[int]] = {}
    for i, p in enumerate(params):
        order.setdefault(p["unit"], []).append(i)
    return [FsdpUnit(name, tuple(idx), (), sum(params[i]["bwd_ms"] for i in idx),
                     any(params[i]["bwd_ms"] > 0 for i in idx)) for name, idx in order.items()], None


def planned_units(model_cfg, params: list[dict], policy: str) -> tuple[list[FsdpUnit], FsdpUnit | None]:
    """fsdp's units in registration order (its forward order on the models here) and its root, taken
    from the strategy's own plan (`plan_units` under `policy`) of the model built on the meta device:
    no memory, no time."""
    from omegaconf import OmegaConf

    from ddp_lab.models.facts import meta_model
    from ddp_lab.spec.strategies.fsdp_units import plan_units

    try:
        cfg = model_cfg if OmegaConf.is_config(model_cfg) else OmegaConf.create(model_cfg)
        plans = plan_units(meta_model(cfg), policy)
    except Exception as exc:  # noqa: BLE001 - a config this version cannot build: say why, predict the rest
        raise PredictError(f"fsdp's unit plan of model {model_cfg.get('name')!r}: {exc}") from None
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
      the forward weight, the root's last.
    - backward: the last unit of the forward is kept; every other unit needed in backward (not a unit
      of embeddings only) is gathered again when the unit after it begins backward (when that one's
      last-but-one neighbour finished), waited for when its own begins; a unit's reduce-scatter (and
      the all-reduce of its replicated gradients) launches when its last gradient is ready; the first
      unit (its inputs need no gradient) and the root are reduced at the end of backward.

    Forward and backward grow by the host copies into storage the strategy allocates at each use: every
    gathered unit copied out into its full parameters, every gradient folded into a new buffer."""
    if not units:
        raise PredictError("fsdp's plan has no unit to shard")
    gathered = [sum(params[i]["bytes"] for i in u.sharded) for u in units]  # in the dtype gathered
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
        starts.append(starts[-1] + forward_ms * u.weight / (total or 1))
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
