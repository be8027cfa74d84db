"""What one training job's step is made of, strategy by strategy, as a `replay.Step`.

Compute comes from the model's profile, scaled to the job: by the tokens each rank computes (the
global batch is split over ranks) and by the core share a rank's compute thread gets at the job's
world size (`fit.share_speeds`); the optimizer by the fraction of parameters this rank updates.
The collectives mirror what each strategy issues (ddp_lab/strategies), each timed by the fitted
alpha-beta of its op at the job's world size:

| strategy | collectives |
|---|---|
| naive | one all-reduce per gradient, blocking, after backward |
| flat | copy into a new buffer, one all-reduce, copy out, after backward |
| overlap | one all-reduce per gradient, launched when it is ready, in reverse parameter order |
| bucketed, torch_ddp | one all-reduce per bucket (`plan_bucket_indices`), launched when the bucket is full |
| zero1 | its grad_sync's collectives, the update of 1/N of the parameters, one broadcast per parameter |
| zero1 comm=reduce_scatter | on gloo a reduce per parameter instead of the all-reduces |
| zero2 | per bucket N reduces of 1/N of it during backward (gloo), the update of 1/N, N broadcasts per bucket |
| local_sgd | every `sync_every` steps one all-reduce of the parameters after the update (see below) |
| powersgd | bucketed's all-reduces, while most measured steps come before `start_iter` |

local_sgd's p50 step is the step without the averaging when sync_every > 2, with it at 1, their mean
at 2. PowerSGD's compressed step (factor matmuls, two all-reduces per bucket) is not modelled yet.

Strategies not listed raise `PredictError` (validate reports the job as not predicted).
"""

from __future__ import annotations

from ddp_lab.analysis.cost_model import plan_bucket_indices
from ddp_lab.analysis.predict.costs import PredictError, collective_ms, share_speeds, slowdowns, tokens_per_rank
from ddp_lab.analysis.predict.replay import Collective, Replayed, Step, replay

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
STRATEGIES = ("naive", "flat", "overlap", "bucketed", "torch_ddp", "zero1", "zero2", "local_sgd", "powersgd")


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

    def coll(op, nbytes, ready_ms=None, label=""):
        return Collective(collective_ms(model["collectives"], backend, op, nbytes, n, dtype), ready_ms, label)

    def bucket_plan(bucket_mb):
        return plan_bucket_indices([p["bytes"] for p in params], [p["dtype"] for p in params], bucket_mb)

    def bucketed(bucket_mb, pad=1):
        out = []
        for b in bucket_plan(bucket_mb):
            nbytes = sum(grad_bytes[i] for i in b)
            nbytes = -(-nbytes // (pad * 4)) * pad * 4 if pad > 1 else nbytes
            out.append(coll("all_reduce", nbytes, max(ready[i] for i in b), f"bucket {b[0]}-{b[-1]}"))
        return out

    updated, opt_comm, comms = 1.0, 0.0, []
    if name == "naive":
        comms = [coll("all_reduce", grad_bytes[i], None, params[i]["name"]) for i in range(len(params))]
    elif name == "flat":
        total = sum(grad_bytes)
        host = model["host"]  # flatten into a new buffer, copy back into the gradients
        copy = total * (1 / host.get("fresh_copy_GBps", host["copy_GBps"]) + 1 / host["copy_GBps"]) / 1e6 * core
        comms = [coll("all_reduce", total, None, "flat"), Collective(copy, None, "flatten + unflatten copies")]
    elif name == "overlap":
        comms = [coll("all_reduce", grad_bytes[i], ready[i], params[i]["name"]) for i in reversed(range(len(params)))]
    elif name in ("bucketed", "torch_ddp"):
        comms = bucketed(strategy.get("bucket_mb") or 25.0)
    elif name == "powersgd":
        train = cfg.get("train", {})
        measured = max(1, train.get("steps", 20) - train.get("warmup_steps", 3))
        plain = max(0, min(strategy.get("start_iter", 10), train.get("steps", 20)) - train.get("warmup_steps", 3))
        if plain <= measured / 2:
            raise PredictError("no replay for powersgd's compressed steps yet (most measured steps come after "
                               "start_iter)")
        comms = bucketed(strategy.get("bucket_mb") or 25.0)
    elif name == "local_sgd":
        every = int(strategy.get("sync_every") or 1)
        share = 1.0 if every == 1 else 0.5 if every == 2 else 0.0  # of the averaging, in the p50 step
        opt_comm = share * coll("all_reduce", sum(p["bytes"] for p in params)).ms if n > 1 else 0.0
    elif name == "zero1":
        updated = 1 / n
        if (strategy.get("comm") or "allreduce_broadcast") == "reduce_scatter":
            comms = [coll("broadcast", grad_bytes[i], None, f"reduce {params[i]['name']}") for i in range(len(params))]
        else:
            sync = {**cfg, "strategy": {"name": strategy.get("grad_sync") or "bucketed",
                                        "bucket_mb": strategy.get("bucket_mb") or 25.0, "comm_dtype": dtype}}
            comms = job_step(model, sync, backend)[0].collectives
        opt_comm = sum(coll("broadcast", p["bytes"]).ms for p in params) if n > 1 else 0.0
    elif name == "zero2":
        updated = 1 / n
        for b in bucket_plan(strategy.get("bucket_mb") or 25.0):
            nbytes = -(-sum(grad_bytes[i] for i in b) // (n * 4)) * n * 4
            part = coll("broadcast", nbytes / n).ms * n if n > 1 else 0.0
            comms.append(Collective(part, max(ready[i] for i in b), f"reduce-scatter {b[0]}-{b[-1]}"))
            opt_comm += part
    step = Step(forward_ms=prof["forward_ms"] * scale, backward_ms=prof["backward_ms"] * scale,
                collectives=comms if n > 1 else [c for c in comms if c.label.startswith("flatten")],
                optimizer_ms=prof["optimizer_ms"] * updated * core, optimizer_comm_ms=opt_comm,
                other_ms=prof["other_ms"] * core,
                compute_slowdown=compute_slowdown, comm_slowdown=comm_slowdown,
                launch_ms=contention.get("launch_ms", 0.0) * core)
    return step, replay(step)


def best_bucket_mb(model: dict, cfg: dict, candidates) -> tuple[float, dict]:
    """The candidate bucket size with the lowest predicted step, and every candidate's step (ms)."""
    steps = {}
    for mb in candidates:
        job = {**cfg, "strategy": {**cfg["strategy"], "bucket_mb": float(mb)}}
        steps[float(mb)] = job_step(model, job)[1].step_ms
    return min(steps, key=steps.get), steps
