"""What one training job's step is made of, strategy by strategy, as a `replay.Step`.

Compute comes from the model's profile, scaled to the job: by the tokens each rank computes (the
global batch is split over ranks) and by the core share a rank's compute thread gets at the job's
world size (`fit.share_speeds`); the optimizer by the fraction of parameters this rank updates.
The collectives mirror what each strategy issues (ddp_lab/strategies), each timed by the fitted
alpha-beta of its op at the job's world size:

| strategy | collectives |
|---|---|
| naive | one all-reduce per gradient, blocking, after backward (timed back to back where swept so) |
| flat | copy into a new buffer, one all-reduce, copy out, after backward |
| overlap | one all-reduce per gradient, launched when it is ready, in reverse parameter order |
| bucketed, torch_ddp | one all-reduce per bucket (`plan_bucket_indices`), launched when the bucket is full |
| zero1 | its grad_sync's collectives, the update of 1/N of the parameters, one broadcast per parameter |
| zero1 comm=reduce_scatter | on gloo a reduce per parameter instead of the all-reduces |
| zero2 | per bucket N reduces of 1/N of it during backward (gloo), the update of 1/N, N broadcasts per bucket |
| local_sgd | every `sync_every` steps one all-reduce of the parameters after the update (see below) |
| powersgd | bucketed's all-reduces while most measured steps come before `start_iter`; else per bucket |
| | the all-reduces of [plain, P's] and of the Q's, each phase's work timed by `fit.powersgd_work` |
| fsdp | its own unit plan (`fsdp_units`): each unit all-gathered before its forward (one ahead) and |
| | again before its backward, reduce-scattered after its backward (see `_fsdp`) |

local_sgd's p50 step is the step without the averaging when sync_every > 2, with it at 1, their mean
at 2.
On gloo an all-gather is N broadcasts of 1/N and a reduce-scatter N reduces of 1/N (as fsdp and
zero2 issue them), each timed by its op's fit (a reduce as a broadcast where the sweep has no
reduce). fsdp's and flat's host copies into new storage are compute work at the host's copy
bandwidth into new memory: on this machine's glibc a freed buffer's pages go back to the OS and
come back with a fault each.
Where gradients are bucket slices (`grads_in_buckets`), forward zeroes the buckets and backward adds
each gradient into its slice, work the profiled overlap run (autograd keeping its own tensors) did
not do.

Strategies not listed raise `PredictError` (validate reports the job as not predicted).
"""

from __future__ import annotations

import dataclasses
import functools

from ddp_lab.analysis.predict.costs import PredictError, collective_ms, share_speeds, slowdowns, tokens_per_rank
from ddp_lab.analysis.predict.replay import Collective, Replayed, Step, replay
from ddp_lab.spec.buckets import DEFAULT_BUCKET_MB, plan_bucket_indices

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
STRATEGIES = ("naive", "flat", "overlap", "bucketed", "torch_ddp", "zero1", "zero2", "local_sgd", "powersgd", "fsdp")


def job_step(model: dict, cfg: dict, backend: str | None = None) -> tuple[Step, Replayed]:
    """The step of the training job configured by `cfg` (a results.json config), and its replay."""
    prof, contention = model["compute"], model["contention"]
    strategy = cfg["strategy"]
    name = strategy["name"]
    if name not in STRATEGIES:
        raise PredictError(f"no replay for strategy {name!r} yet (predicted: {', '.join(STRATEGIES)})")
    if cfg["model"]["name"] != prof["model"]:
        raise PredictError(f"the profile is of model {prof['model']!r}, the job trains {cfg['model']['name']!r}")
    for key, default in (("precision", "fp32"), ("grad_accum_steps", 1)):
        mine, profiled = cfg.get("train", {}).get(key, default), prof.get(key, default)
        if mine != profiled:
            raise PredictError(f"the profile ran train.{key}={profiled}, the job {mine}: profile one like it")
    n = int(cfg["world_size"])
    backend = backend or prof["backend"]
    here = share_speeds(n, prof["cpus"], prof["threads_per_rank"], contention["u"])
    there = share_speeds(prof["world_size"], prof["cpus"], prof["threads_per_rank"], contention["u"])
    core = there["compute_alone"] / here["compute_alone"]
    compute_slowdown, comm_slowdown = slowdowns(contention, n, prof["world_size"], prof["cpus"],
                                                prof["threads_per_rank"])
    scale = tokens_per_rank(cfg) / prof["tokens_per_rank"] * core
    wire = DTYPE_BYTES[strategy.get("comm_dtype") or "fp32"] / 4
    dtype = strategy.get("comm_dtype") or "fp32"
    params = prof["params"]
    grad_bytes = [p["bytes"] * wire for p in params]
    ready = [p["ready_ms"] * scale for p in params]  # backward work (ms) when each gradient is ready
    forward_ms, backward_ms = prof["forward_ms"] * scale, prof["backward_ms"] * scale
    launch_ms = contention.get("launch_ms", 0.0) * core

    def coll(op, nbytes, ready_ms=None, label="", back_to_back=False):
        return Collective(collective_ms(model["collectives"], backend, op, nbytes, n, dtype, back_to_back),
                          ready_ms, label)

    def bucket_plan(bucket_mb):
        return plan_bucket_indices([p["bytes"] for p in params], [p["dtype"] for p in params], bucket_mb)

    def bucketed(bucket_mb, pad=1):
        out = []
        for b in bucket_plan(bucket_mb):
            nbytes = sum(grad_bytes[i] for i in b)
            nbytes = -(-nbytes // (pad * 4)) * pad * 4 if pad > 1 else nbytes
            out.append(coll("all_reduce", nbytes, max(ready[i] for i in b), f"bucket {b[0]}-{b[-1]}"))
        return out

    def swept(op):
        """`op`, or broadcast where the sweep did not time it (a reduce moves a broadcast's bytes)."""
        return op if op in model["collectives"].get(backend, {}) else "broadcast"

    def per_rank_calls_ms(op, nbytes):
        """N calls of `op` (broadcast or reduce) on 1/N of `nbytes` each, one per rank: gloo's stand-in
        for a sharded collective."""
        return n * coll(swept(op), nbytes / n).ms

    def sharded_ms(op, nbytes):
        """An all-gather / reduce-scatter of `nbytes` in all: its own fit, else N broadcasts / reduces of 1/N."""
        try:
            return coll(op, nbytes).ms
        except PredictError:
            return per_rank_calls_ms("broadcast" if op == "all_gather" else "reduce", nbytes)

    def host_ms(op, nbytes):
        """`nbytes` through `op` (fit.HOST_OPS: a copy into a used or a new buffer, an add, a zeroing) on
        a rank's compute thread. An op an older model file did not time: a copy's figure for a copy
        into a new buffer, nothing for the others."""
        host = model["host"]
        rate = host.get(f"{op}_GBps") or (host["copy_GBps"] if op == "fresh_copy" else None)
        return nbytes / rate / 1e6 * core if rate else 0.0

    if grads_in_buckets(strategy):  # the bucket zeroed before forward, each gradient added into its slice
        forward_ms += host_ms("zero", sum(p["bytes"] for p in params))
        added, shifted = 0.0, list(ready)
        for i in sorted(range(len(params)), key=lambda i: ready[i]):
            added += host_ms("add", params[i]["bytes"])
            shifted[i] = ready[i] + added
        ready, backward_ms = shifted, backward_ms + added

    updated, opt_comm, comms, forward = 1.0, 0.0, [], None
    bucket_mb = strategy.get("bucket_mb") or DEFAULT_BUCKET_MB
    if name == "naive":
        comms = [coll("all_reduce", grad_bytes[i], None, params[i]["name"], back_to_back=True)
                 for i in range(len(params))]
    elif name == "flat":
        total = sum(grad_bytes)  # flatten into a new buffer, copy back into the gradients
        copy = host_ms("fresh_copy", total) + host_ms("copy", total)
        comms = [coll("all_reduce", total, None, "flat"), Collective(copy, None, "flatten + unflatten copies")]
    elif name == "overlap":
        comms = [coll("all_reduce", grad_bytes[i], ready[i], params[i]["name"]) for i in reversed(range(len(params)))]
    elif name in ("bucketed", "torch_ddp"):
        comms = bucketed(bucket_mb)
    elif name == "powersgd":
        train = cfg.get("train", {})
        measured = max(1, train.get("steps", 20) - train.get("warmup_steps", 3))
        plain = max(0, min(strategy.get("start_iter", 10), train.get("steps", 20)) - train.get("warmup_steps", 3))
        if plain > measured / 2:  # the p50 step is a plain one
            comms = bucketed(bucket_mb)
        else:
            work = model["host"].get("powersgd")
            if not work or not work["numel"] or any("shape" not in p for p in params):
                raise PredictError("the replay of powersgd's compressed steps needs a model fitted by this version "
                                   "from a profile with parameter shapes: fit again, profile again")

            def work_ms(phase, param):
                return work["phase_ms"][phase - 1] * param["numel"] / work["numel"] * core

            backward_ms, comms = _powersgd(params, bucket_plan(bucket_mb), ready,
                                           backward_ms, int(strategy.get("rank") or 1), work_ms,
                                           functools.partial(coll, "all_reduce"))
    elif name == "local_sgd":
        every = int(strategy.get("sync_every") or 1)
        share = 1.0 if every == 1 else 0.5 if every == 2 else 0.0  # of the averaging, in the p50 step
        opt_comm = share * coll("all_reduce", sum(p["bytes"] for p in params)).ms if n > 1 else 0.0
    elif name == "zero1":
        updated = 1 / n
        if (strategy.get("comm") or "allreduce_broadcast") == "reduce_scatter":
            comms = [coll(swept("reduce"), grad_bytes[i], None, f"reduce {params[i]['name']}")
                     for i in range(len(params))]
        else:
            sync = {**cfg, "strategy": {"name": strategy.get("grad_sync") or "bucketed",
                                        "bucket_mb": bucket_mb, "comm_dtype": dtype}}
            comms = job_step(model, sync, backend)[0].collectives
        opt_comm = sum(coll("broadcast", p["bytes"]).ms for p in params) if n > 1 else 0.0
    elif name == "zero2":
        updated = 1 / n
        for b in bucket_plan(bucket_mb):
            nbytes = -(-sum(grad_bytes[i] for i in b) // (n * 4)) * n * 4
            comms.append(Collective(per_rank_calls_ms("reduce", nbytes), max(ready[i] for i in b),
                                    f"reduce-scatter {b[0]}-{b[-1]}"))
            opt_comm += per_rank_calls_ms("broadcast", nbytes)
    elif name == "fsdp":
        updated = 1 / n
        units, root = fsdp_units(cfg, params)
        reshard = strategy.get("reshard_after_forward")
        forward_ms, backward_ms, gathers, comms = _fsdp(
            units, root, params, forward_ms, backward_ms, ready, grad_bytes, sharded_ms,
            lambda nbytes: coll("all_reduce", nbytes).ms, True if reshard is None else bool(reshard),
            lambda nbytes: host_ms("fresh_copy", nbytes))
        forward = replay(Step(0.0, forward_ms, gathers if n > 1 else [], compute_slowdown=compute_slowdown,
                              comm_slowdown=comm_slowdown, launch_ms=launch_ms))
    step = Step(forward_ms=forward_ms if forward is None else forward.backward_end_ms, backward_ms=backward_ms,
                collectives=comms if n > 1 else [c for c in comms if c.label.startswith("flatten")],
                optimizer_ms=prof["optimizer_ms"] * updated * core, optimizer_comm_ms=opt_comm,
                other_ms=prof["other_ms"] * core,
                compute_slowdown=compute_slowdown, comm_slowdown=comm_slowdown, launch_ms=launch_ms)
    replayed = replay(step)
    if forward is not None:  # fsdp: the forward's waits for its gathers are exposed too
        replayed = dataclasses.replace(replayed, exposed_ms=replayed.exposed_ms + forward.stalled_ms,
                                       comm_ms=replayed.comm_ms + forward.comm_ms,
                                       hidden_ms=replayed.hidden_ms + forward.hidden_ms,
                                       stalled_ms=replayed.stalled_ms + forward.stalled_ms)
    return step, replayed


def grads_in_buckets(strategy: dict) -> bool:
    """Whether the strategy's gradients are slices of its buckets (strategies/bucketed.py): autograd
    then adds each gradient into a zeroed slice where it otherwise keeps the tensor it computed."""
    name = strategy["name"]
    if name == "zero1":
        return (strategy.get("comm") or "allreduce_broadcast") != "reduce_scatter" and \
            (strategy.get("grad_sync") or "bucketed") == "bucketed"
    return name in ("bucketed", "powersgd", "zero2")


@dataclasses.dataclass(frozen=True)
class FsdpUnit:
    """One unit of fsdp's plan as the replay needs it: indices into the profile's parameters."""

    name: str
    sharded: tuple[int, ...]
    replicated: tuple[int, ...]
    weight: int                 # parameters a matmul multiplies by (not lookups): its share of the compute
    needed_in_backward: bool


def fsdp_units(cfg: dict, params: list[dict]) -> tuple[list[FsdpUnit], FsdpUnit | None]:
    """fsdp's units in registration order (its forward order on the models here) and its root, taken
    from the strategy's own plan (`strategies/fsdp/policy.plan_units`, the job's `strategy.policy`)
    of the job's model built on the meta device: no memory, no time."""
    import torch
    from omegaconf import OmegaConf

    from ddp_lab.models import build_model
    from ddp_lab.strategies.fsdp.policy import plan_units

    try:
        with torch.device("meta"):
            module = build_model(OmegaConf.create(cfg["model"]))
        plans = plan_units(module, cfg["strategy"].get("policy") or "linear_embedding")
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
