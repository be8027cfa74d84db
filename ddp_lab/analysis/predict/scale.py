"""`scale`: a strategy's step on a named GPU system at any world size, from formulas alone.

The model is a conf model (counted below) or any model described by its parameters and compute
(`described_workload`, `scale --model FILE.json`); each row also replays the step on torch's own
collective estimate (torch_estimate.py) and gives torch's FSDP bucket rule beside the best bucket.

Compute: measured where the measured table has the model on the system's GPU (measured.py: the same
batch, or interpolated or scaled by tokens from others), else the model's FLOPs per token, counted on the model built
on the meta device (ddp_lab/models/facts.py), at the system's peak times its assumed MFU; every output
says which. Each parameter's gradient is ready when backward has done the FLOPs of everything after it
(output first). Mixed precision (bf16 weights and gradients
on the wire, fp32 master weights and AdamW: 16 bytes per parameter, ZeRO's accounting); the
optimizer is memory-bound: 28 bytes per parameter it updates (read fp32 master, m, v and the bf16
gradient, write master, m, v and the bf16 weight) at the GPU's memory bandwidth. Collectives: the
system's NCCL model (systems.py). Overlap: the same replay as on this machine (replay.py), with no
slowdown between compute and communication (NCCL runs on its own SMs; what it takes from compute is
ignored). Weak scaling: the per-GPU batch is fixed, so efficiency = step at one node / step at N.

Tensor parallelism (`--tp T`, a conf model with a TP plan): each GPU holds 1/T of every parameter and does 1/T of
the compute and of the optimizer (the norms a TP group keeps whole counted at 1/T too: a rounding); the strategy
runs on the N/T ranks of the dp axis (priced as N/T ranks of the system, however they spread over the nodes);
TP's collectives (spec/parallel.py's schedule, bf16 activations, priced over T ranks: inside a node when T is at
most its GPUs) block forward and backward, so they add to the step whole.

Context parallelism (`--cp C`, a conf Transformer; the zigzag ring): the `batch` sequences of a data-parallel shard
are split over C GPUs by tokens, so each does 1/C of the compute (zigzag: every rank the same attention) while
holding every parameter; the strategy averages over the N/T ranks of dp x cp. The ring's exchange per layer is
spec/context.py's (bf16 K/V, fp32 dK/dV accumulators), priced as the collectives that move the same bytes over C
ranks (an all-gather of K/V forward and again backward, a reduce-scatter of dK/dV); it can hide under the attention
of the layer's blocks (the attention's share of the FLOPs, models/facts.py's count), so only what outlasts that
attention is exposed, and the step gains that. Both figures are printed.

Strategies: every one whose spec declares a schedule (spec/schedule.py) that scale can replay, each
with its default knobs and, where it has buckets, the best of BUCKET_MB. The schedule is interpreted
by interpret.py, the same interpreter as a job's on this machine, with `NcclCosts` as its prices; fsdp's
units are its own plan of a conf model, or a described model's units. Low-rank compression and
averaging every k steps are not replayed here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ddp_lab.analysis.predict import measured, torch_estimate
from ddp_lab.analysis.predict.costs import PredictError
from ddp_lab.analysis.predict.interpret import Work, interpret, planned_units, units_by_name
from ddp_lab.analysis.predict.nccl import collective_s
from ddp_lab.analysis.predict.systems import System, busbw
from ddp_lab.arithmetic.buckets import DEFAULT_BUCKET_MB
from ddp_lab.config import compose_model
from ddp_lab.models.facts import flops_per_token, parameter_facts
from ddp_lab.spec.schedule import Schedule
from ddp_lab.spec.strategies import SPECS

BUCKET_MB = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000)
WIRE_BYTES = 2          # bf16 gradients and parameters on the wire
OPTIMIZER_BYTES = 28    # per updated parameter, see module docstring


def load_model(name: str, context_length: int | None = None):
    """conf/model/NAME.yaml, composed as launch.py composes it (any model: its facts are counted from
    it), or a model description (a .json file: described_workload's form)."""
    if str(name).endswith(".json"):
        import json
        from pathlib import Path

        try:
            return json.loads(Path(name).read_text())
        except (OSError, ValueError) as exc:
            raise PredictError(f"cannot read model description {name}: {exc}") from None
    try:
        return compose_model(name, {"context_length": context_length} if context_length else None)
    except ValueError as exc:
        raise PredictError(str(exc)) from None


def parameters(cfg) -> list[dict]:
    """The model's parameters in `parameters()` order, counted on the meta device (models/facts.py), each
    with its backward FLOPs per token (`bwd`)."""
    return parameter_facts(cfg)


def nccl_seconds(system: System, op: str, nbytes: float, n: int) -> float:
    """ddp-lab's NCCL model (nccl.py): the fastest algorithm and protocol, seconds."""
    return collective_s(system, op, nbytes, n)[0]


def has_buckets(strategy: str) -> bool:
    return "bucket_mb" in SPECS[strategy].__dataclass_fields__


def _plan(strategy: str, bucket_mb: float = DEFAULT_BUCKET_MB) -> Schedule | None:
    return SPECS[strategy](**({"bucket_mb": bucket_mb} if has_buckets(strategy) else {})).schedule()


def _replayable(plan: Schedule | None) -> bool:
    return plan is not None and plan.low_rank is None and (plan.parameters is None or plan.parameters.every == 1)


def scalable() -> list[str]:
    """The registered strategies scale replays."""
    return [name for name in SPECS if _replayable(_plan(name))]


def schedule(strategy: str, bucket_mb: float = DEFAULT_BUCKET_MB) -> Schedule:
    """The schedule of `strategy` with its default knobs (and `bucket_mb` where it has buckets), or a
    one-line PredictError for a strategy scale cannot replay: one with no schedule, low-rank compression
    or averaging every k steps."""
    if strategy not in SPECS:
        raise PredictError(f"unknown strategy {strategy!r} for scale; options: {', '.join(scalable())}")
    plan = _plan(strategy, bucket_mb)
    if not _replayable(plan):
        raise PredictError(f"scale does not replay strategy {strategy!r} (no schedule, low-rank compression or "
                           f"averaging every k steps); options: {', '.join(scalable())}")
    return plan


@dataclass(frozen=True)
class Workload:
    """What scale replays for one GPU's step: the trainable parameters in registration order (`numel`,
    `bwd_ms`: backward compute that makes the gradient ready, `unit`: the ZeRO-3 unit), forward and
    backward compute (ms), the optimizer (ms, all parameters), and bytes per element on the wire."""

    name: str
    params: list
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    wire_bytes: int = WIRE_BYTES
    cfg: object = None           # the conf model it was counted from (None: a described model)
    compute: measured.Compute | None = None  # where a conf model's compute came from (None: a described model)
    _units: dict = field(default_factory=dict, compare=False, repr=False)

    def units(self, policy: str):
        """fsdp's units under `policy`, planned once per workload (every bucket size and world size a row
        replays asks again): its own plan of a conf model, or a described model's `unit` fields."""
        if policy not in self._units:
            self._units[policy] = planned_units(self.cfg, self.params, policy) if self.cfg is not None \
                else units_by_name(self.params)
        return self._units[policy]


def transformer_workload(system: System, cfg, batch: int, table: list[dict] | None = None,
                         compiled: bool = False) -> Workload:
    """A conf/model counted on the meta device, `batch` sequences per GPU: compute measured where `table`
    (the lab's measured table when None) has it, else from FLOPs at the system's peak x MFU; the
    optimizer measured with it, else memory-bound (module docstring)."""
    tokens = batch * cfg.context_length
    fpt, facts = flops_per_token(cfg), parameters(cfg)
    n_params = sum(p["numel"] for p in facts)
    compute = measured.compute(system, cfg, batch, fpt, n_params, OPTIMIZER_BYTES * n_params / system.hbm_Bps * 1e3,
                               compiled=compiled, table=measured.load_table() if table is None else table)
    ms_per_flop = compute.backward_ms / (fpt["backward"] * tokens)
    params = [{**p, "bwd_ms": p["bwd"] * tokens * ms_per_flop} for p in facts]
    return Workload(name=cfg.name if "name" in cfg else "model", params=params, forward_ms=compute.forward_ms,
                    backward_ms=compute.backward_ms, optimizer_ms=compute.optimizer_ms, cfg=cfg, compute=compute)


def described_workload(system: System, desc: dict, batch: int | None = None) -> Workload:
    """A model given by its parameters and compute (any model: `scale --model FILE.json`, docs/notebook/predict.md):

        {"name": "resnet50", "wire_bytes": 4,
         "compute_ms": {"forward": 32.3, "backward": 64.7, "optimizer": 0},     # one GPU's step, or
         "flops_per_sample": {"forward": 8.2e9, "backward": 16.4e9}, "batch": 32, # at peak x MFU
         "parameters": [{"name": "conv1.weight", "numel": 9408, "backward_flops": 2.4e8, "unit": "stem"}, ...]}

    Parameters in registration order; `backward_flops` (any unit: only the shares count) place each
    gradient's ready time within backward (default: by size); `unit` groups them for ZeRO-3 (default:
    one unit per parameter-name prefix before the last dot). The optimizer defaults to 28 bytes per
    parameter at the GPU's memory bandwidth."""
    try:
        raw = [dict(p) for p in desc["parameters"]]
        params = [{"name": str(p.get("name", f"p{i}")), "numel": int(p["numel"]),
                   "work": float(p.get("backward_flops", p["numel"])),
                   "unit": str(p.get("unit") or str(p.get("name", f"p{i}")).rsplit(".", 1)[0])}
                  for i, p in enumerate(raw)]
        if "compute_ms" in desc:
            forward, backward = float(desc["compute_ms"]["forward"]), float(desc["compute_ms"]["backward"])
        else:
            samples = batch if batch is not None else int(desc["batch"])
            ms_per_flop = 1e3 / (system.peak_flops * system.mfu)
            forward = float(desc["flops_per_sample"]["forward"]) * samples * ms_per_flop
            backward = float(desc["flops_per_sample"]["backward"]) * samples * ms_per_flop
    except (KeyError, TypeError, ValueError) as exc:
        raise PredictError(f"model description {desc.get('name', '?') if isinstance(desc, dict) else '?'}: "
                           f"missing or bad field ({exc}); see docs/notebook/predict.md") from None
    if not params or any(p["numel"] <= 0 for p in params):
        raise PredictError("model description: needs parameters, each with numel > 0")
    total = sum(p["work"] for p in params)
    for p in params:
        p["bwd_ms"] = backward * p.pop("work") / total
    n_params = sum(p["numel"] for p in params)
    optimizer = desc.get("compute_ms", {}).get("optimizer")
    return Workload(name=str(desc.get("name", "model")), params=params, forward_ms=forward, backward_ms=backward,
                    optimizer_ms=float(optimizer) if optimizer is not None
                    else OPTIMIZER_BYTES * n_params / system.hbm_Bps * 1e3,
                    wire_bytes=int(desc.get("wire_bytes", WIRE_BYTES)))


def workload(system: System, model, batch: int, table: list[dict] | None = None, compiled: bool = False) -> Workload:
    """A conf model (counted; its compute measured where `table` has it) or a description (dict) as scale
    replays it."""
    return described_workload(system, model, batch) if isinstance(model, dict) else \
        transformer_workload(system, model, batch, table, compiled)


class NcclCosts:
    """A GPU system's prices (interpret.Costs): each collective by `seconds(system, op, bytes, n)` (ddp-lab's
    NCCL model, or torch's estimator); a host copy reads and writes its bytes at the GPU's memory
    bandwidth; the zeroing and adds of gradients kept in buckets are not priced (an assumption, as before
    the one interpreter: the MFU's compute is taken to cover these memory-bound kernels of backward); no
    contention: NCCL runs on SMs of its own. PowerSGD's phases have no price here."""

    compute_slowdown = comm_slowdown = 1.0
    launch_ms = 0.0

    def __init__(self, system: System, n: int, seconds=nccl_seconds):
        self.system, self.n, self.seconds = system, n, seconds

    def collective(self, op: str, nbytes: float, back_to_back: bool = False) -> float:
        return self.seconds(self.system, op, nbytes, self.n) * 1e3

    def sharded(self, op: str, nbytes: float) -> float:
        return self.collective(op, nbytes)

    def host(self, op: str, nbytes: float) -> float:
        return 2 * nbytes / self.system.hbm_Bps * 1e3 if op in ("copy", "fresh_copy") else 0.0

    def powersgd_work(self, phase: int, param: dict) -> float:
        raise PredictError("scale has no price for powersgd's compression work")


def work_of(w: Workload, first_bucket_mb: float | None = None) -> Work:
    """A Workload as interpret.py takes it: every parameter gathered and every gradient sent in the wire
    dtype, each gradient ready once backward has done the work of everything after it (output first);
    fsdp's units from its own plan of a conf model, or a described model's `unit` fields."""
    params = [{**p, "bytes": p["numel"] * w.wire_bytes, "dtype": "wire"} for p in w.params]
    ready, done = [0.0] * len(params), 0.0
    for i in reversed(range(len(params))):
        done += params[i]["bwd_ms"]
        ready[i] = min(done, w.backward_ms)
    return Work(params=params, wire=[p["bytes"] for p in params], ready=ready, forward_ms=w.forward_ms,
                backward_ms=w.backward_ms, optimizer_ms=w.optimizer_ms, units=w.units, first_bucket_mb=first_bucket_mb)


def split_workload(w: Workload, tp: int) -> Workload:
    """One GPU's share of a step under `tp`-way tensor parallelism (module docstring): 1/tp of every parameter, of
    forward, backward and the optimizer."""
    if tp == 1:
        return w
    params = [{**p, "numel": -(-p["numel"] // tp), "bwd_ms": p["bwd_ms"] / tp} for p in w.params]
    return replace(w, params=params, forward_ms=w.forward_ms / tp, backward_ms=w.backward_ms / tp,
                   optimizer_ms=w.optimizer_ms / tp, _units={})


def tp_ms(system: System, cfg, tp: int, batch: int, seconds=nccl_seconds, sequence_parallel: bool = False) -> float:
    """TP's collectives of one GPU's step (`batch` sequences of the model's context, bf16 activations), each priced
    by `seconds` over `tp` ranks and added whole (they block forward and backward)."""
    if tp == 1:
        return 0.0
    if cfg is None:
        raise PredictError("--tp needs a conf model with a tensor-parallel plan, not a described one")
    from ddp_lab.models.facts import meta_model, tp_layers
    from ddp_lab.spec.parallel import plan_problem, tp_schedule

    plan, shapes, partial = tp_layers(meta_model(cfg))
    problem = plan_problem(plan, shapes, tp)
    if problem is not None:
        raise PredictError(f"--tp {tp}: {problem}")
    collectives = tp_schedule(plan, shapes, tp, sequence_parallel, batch * cfg.context_length, WIRE_BYTES, partial)
    return sum(seconds(system, c.op, c.nbytes, tp) for c in collectives) * 1e3


def cp_ms(system: System, cfg, w: "Workload", cp: int, batch: int, seconds=nccl_seconds) -> tuple[float, float]:
    """(the ring's exchange, the part of it exposed) in ms of one GPU's step under `cp`-way context parallelism
    (module docstring); `w`: the GPU's workload, already split."""
    if cp == 1:
        return 0.0, 0.0
    if cfg is None or "num_heads" not in cfg:
        raise PredictError("--cp needs a conf Transformer (attention to split a sequence over), not a described model")
    from ddp_lab.spec.context import context_problem

    problem = context_problem(cp, "zigzag", 2, cfg.context_length, cfg.num_heads, 1, False)
    if problem is not None:
        raise PredictError(f"--cp {cp}: {problem}")
    tokens = batch * cfg.context_length // cp
    kv = 2 * tokens * cfg.d_model * cp  # the whole K and V a ring moves: each rank sends (cp-1)/cp of it, forward
    # (exchange_bytes' 2(cp-1) t d_kv b), the same again backward with the dK/dV accumulators in fp32
    grads = kv * 4 / WIRE_BYTES
    per_layer = (2 * seconds(system, "all_gather", kv * WIRE_BYTES, cp) + seconds(system, "reduce_scatter", grads, cp))
    exchange = cfg.num_layers * per_layer * 1e3
    # attention's share of the compute: 4 x context x d_model FLOPs per token and layer, as the FLOP counter counts
    # scaled_dot_product_attention (the whole square; a causal kernel does about half of it)
    share = cfg.num_layers * 4 * cfg.context_length * cfg.d_model / flops_per_token(cfg)["forward"]
    attention = (w.forward_ms + w.backward_ms) * share / 2  # the causal half the blocks compute
    return exchange, max(0.0, exchange - attention)


def split_context(w: Workload, cp: int) -> Workload:
    """One GPU's share of a step under `cp`-way context parallelism: 1/cp of the forward and backward (and of each
    gradient's readiness), every parameter and the whole optimizer."""
    if cp == 1:
        return w
    params = [{**p, "bwd_ms": p["bwd_ms"] / cp} for p in w.params]
    return replace(w, params=params, forward_ms=w.forward_ms / cp, backward_ms=w.backward_ms / cp, _units={})


def step_ms(system: System, model, n: int, strategy: str, batch: int = 4, bucket_mb: float = DEFAULT_BUCKET_MB,
            first_bucket_mb: float | None = None, seconds=nccl_seconds, tp: int = 1, cp: int = 1) -> dict:
    """Predicted step (ms) of one strategy at world size n with `batch` sequences per data-parallel shard; `model` a
    conf model, a description (dict) or a Workload. `first_bucket_mb`: torch DDP's smaller first bucket;
    `seconds(system, op, bytes, n)`: the collective model (torch_estimate.seconds: torch's, the reference); `tp`:
    tensor parallelism's degree, `cp` context parallelism's (n = dp x cp x tp; module docstring)."""
    if n < 1:
        raise PredictError(f"world size must be >= 1, got {n}")
    if n % (tp * cp):
        raise PredictError(f"--tp {tp} x --cp {cp} does not divide world size {n}")
    plan = schedule(strategy, bucket_mb)
    whole = model if isinstance(model, Workload) else workload(system, model, batch)
    w = split_context(split_workload(whole, tp), cp)
    step, r = interpret(plan, work_of(w, first_bucket_mb), NcclCosts(system, n // tp, seconds))
    tensor = tp_ms(system, whole.cfg, tp, batch, seconds)
    context, exposed = cp_ms(system, whole.cfg, w, cp, batch, seconds)
    return {"step_ms": r.step_ms + tensor + exposed, "exposed_ms": r.exposed_ms + tensor + exposed,
            "comm_ms": r.comm_ms + tensor + context, "tp_ms": tensor, "cp_ms": context, "cp_unhidden_ms": exposed,
            "compute_ms": w.forward_ms + w.backward_ms, "optimizer_ms": step.optimizer_ms}


def compute_bound_tokens(system: System, cfg, n: int, strategy: str, flops: float | None = None) -> float:
    """Tokens per GPU above which the compute communication can hide behind (backward; ZeRO-3: forward
    and backward) outlasts the strategy's communication at large-message bandwidth, latency ignored:
    link bytes (`Schedule.link_bytes`) / busbw = tokens * FLOPs per token / FLOP/s. Data parallelism in
    bf16 at large N: 4P / W = tokens * 4P / C, tokens = C / W (the Scaling Book's bound)."""
    if n <= 1:
        return 0.0
    plan = schedule(strategy)
    P = sum(p["numel"] for p in parameters(cfg)) * WIRE_BYTES
    seconds = plan.link_bytes(P, P, n) / busbw(system, n)
    fpt = flops_per_token(cfg)
    per_token = fpt["step"] if plan.units is not None else fpt["backward"]  # what the communication can hide behind
    rate = flops if flops is not None else system.peak_flops * system.mfu
    return seconds * rate / per_token


def scale_rows(system: System, model, world_sizes, strategies, batch: int, table: list[dict] | None = None,
               compiled: bool = False, tp: int = 1, cp: int = 1) -> list[dict]:
    """One row per strategy and world size; `model` a conf model or a description (dict), a conf model's
    compute measured where `table` has it (workload), or a Workload already made. Beside the best bucket,
    torch's FSDP bucket rule (torch_estimate.min_saturation_bytes) for the gradient op. `tp`, `cp`: each world size
    as dp x cp x tp (the calculator's `--tp` has the mesh's compute-bound batches: none here)."""
    w = model if isinstance(model, Workload) else workload(system, model, batch, table, compiled)
    rate = None if w.cfg is None else \
        flops_per_token(w.cfg)["backward"] * batch * w.cfg.context_length / (w.backward_ms * 1e-3)
    rows = []
    for strategy in strategies:
        plan = schedule(strategy)
        for n in world_sizes:
            if n < 1:
                raise PredictError(f"world size must be >= 1, got {n}")
            base_n = max(tp * cp, min(n, system.gpus_per_node))
            best_mb = base_mb = torch_mb = None
            if has_buckets(strategy):
                best_mb = min(BUCKET_MB, key=lambda mb: step_ms(system, w, n, strategy, batch, mb, tp=tp,
                                                                cp=cp)["step_ms"])
                base_mb = min(BUCKET_MB, key=lambda mb: step_ms(system, w, base_n, strategy, batch, mb,
                                                                tp=tp, cp=cp)["step_ms"])
                op = plan.gradients.op if plan.gradients is not None else "all_reduce"
                rule = torch_estimate.min_saturation_bytes(system, op if op != "reduce" else "reduce_scatter",
                                                           n // tp)
                torch_mb = None if rule is None else rule / 2**20
            at = step_ms(system, w, n, strategy, batch, best_mb or DEFAULT_BUCKET_MB, tp=tp, cp=cp)
            theirs = step_ms(system, w, n, strategy, batch, best_mb or DEFAULT_BUCKET_MB,
                             seconds=torch_estimate.seconds, tp=tp, cp=cp)
            base = step_ms(system, w, base_n, strategy, batch, base_mb or DEFAULT_BUCKET_MB, tp=tp, cp=cp)
            rows.append({"strategy": strategy, "world_size": n, "tp": tp, "cp": cp, "step_ms": at["step_ms"],
                         "exposed_ms": at["exposed_ms"], "comm_ms": at["comm_ms"], "tp_ms": at["tp_ms"],
                         "cp_ms": at["cp_ms"], "cp_unhidden_ms": at["cp_unhidden_ms"],
                         "torch_step_ms": theirs["step_ms"],
                         "efficiency": base["step_ms"] / at["step_ms"],
                         "best_bucket_mb": best_mb, "torch_rule_mb": torch_mb,
                         "compute_bound_tokens": None if w.cfg is None or tp * cp > 1 else
                         compute_bound_tokens(system, w.cfg, n, strategy, rate)})
    return rows


def plot(rows: list[dict], path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        pts = [r for r in rows if r["strategy"] == strategy]
        xs = [r["world_size"] for r in pts]
        a.plot(xs, [r["step_ms"] for r in pts], marker="o", label=strategy)
        b.plot(xs, [100 * r["efficiency"] for r in pts], marker="o", label=strategy)
    for ax, label in ((a, "predicted step time (ms)"), (b, "scaling efficiency vs one node (%)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("world size (GPUs)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    a.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def world_sizes_arg(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise PredictError(f"world sizes must be integers, got {text!r}") from None
    if not sizes or any(n < 1 for n in sizes):
        raise PredictError(f"world sizes must be >= 1, got {text!r}")
    return sizes
