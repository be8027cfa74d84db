"""Memory and communication calculator for a model and every strategy: the assignment's accounting, as a tool.

    python -m ddp_lab.calculator model=small world_size=8 dtype=bf16 flops=989e12 bandwidth=450e9
    python -m ddp_lab.calculator --model xl --world-size 64 --strategy bucketed,zero1,zero2,fsdp --json
    python -m ddp_lab.calculator model=small strategy=zero1 strategy.comm=reduce_scatter
    python -m ddp_lab.calculator --model xxl_ffn --world-size 64 --tp 4 --strategy fsdp --flops 4.6e14 \
        --bandwidth dp=3.6e11,tp=1.8e11          # a mesh: analysis/mesh_accounting.py
    python -m ddp_lab.calculator --model tiny --world-size 2 --pp 2 --microbatches 4 --schedule 1f1b \
        --dtype fp32                             # a pipeline: analysis/pipeline_accounting.py

Answers, per device and per strategy (each with its spec's default knobs, or the ones given): bytes of
parameters, gradients and optimizer state (fp32 training, or mixed-precision bf16 Adam at 16 bytes per
parameter as in the ZeRO paper) as the strategy's ZeRO stage shards them over N ranks; bytes each rank's
link carries per step, from the collective schedule the strategy's spec declares; and the per-device
batch at which backward's compute takes as long as that communication, i.e. the batch above which a
device is compute-bound rather than communication-bound.

The model's facts (parameters by use, FLOPs per token) are counted from the model itself, built on the
meta device (ddp_lab/models/facts.py): nothing is allocated or run, and any model works.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

from ddp_lab.arithmetic.zero_bytes import DTYPE_BYTES, model_state_bytes
from ddp_lab.config import compose_model, key_values
from ddp_lab.models.facts import flops_per_token, parameter_counts, parameter_facts
from ddp_lab.spec.schedule import Schedule
from ddp_lab.spec.strategies import SPECS, SpecError, spec_of
from ddp_lab.spec.strategy import StrategySpec


def load_model_config(name: str, overrides: dict | None = None):
    """conf/model/NAME.yaml as launch.py composes it, with `overrides` merged on top."""
    return compose_model(name, overrides)


def strategy_specs(names, knobs: dict | None = None) -> list[StrategySpec]:
    """Each named strategy's spec with its defaults and, of `knobs`, those it has (ValueError otherwise)."""
    out = []
    for name in names:
        if name not in SPECS:
            raise ValueError(f"unknown strategy {name!r}; options: {', '.join(SPECS)}")
        own = {f.name for f in fields(SPECS[name])}
        try:
            out.append(spec_of({"name": name, **{k: v for k, v in (knobs or {}).items() if k in own}}))
        except SpecError as exc:
            raise ValueError(str(exc)) from None
    unused = set(knobs or {}) - {f.name for spec in out for f in fields(spec)}
    if unused:
        raise ValueError(f"strategy.{sorted(unused)[0]} is not a knob of any strategy asked for")
    return out


def low_rank_elements(params: list[dict], rank: int) -> int:
    """Elements PowerSGD sends per step for `params` (each with its `shape`): a matrix n x m as its rank-r
    factors P (n x r) and Q (m x r) where they are smaller, everything else whole."""
    total = 0
    for p in params:
        shape = p["shape"]
        n, m = (shape[0], p["numel"] // shape[0]) if len(shape) >= 2 else (0, 0)
        r = min(rank, n, m)
        total += (n + m) * r if len(shape) >= 2 and n * m > (n + m) * r else p["numel"]
    return total


def link_bytes(spec: StrategySpec, plan: Schedule, model_cfg, n_params: int, dtype: str, world_size: int) -> float:
    """Bytes over each rank's link per step for the strategy's schedule (nccl-tests' bus convention)."""
    wire = DTYPE_BYTES[dtype][1]
    nbytes = plan.link_bytes(wire * n_params, wire * n_params, world_size)
    if nbytes is None and plan.low_rank is not None and plan.gradients is not None:  # compressed steps
        elements = low_rank_elements(parameter_facts(model_cfg), plan.low_rank.rank)
        nbytes = 2 * (world_size - 1) / world_size * wire * elements
    return nbytes


def compute_bound_batch(model_cfg, comm_bytes: float, flops: float, bandwidth: float, overlap: str = "backward"
                        ) -> float:
    """Sequences per device at which compute time equals communication time.

    Compute time for B sequences: B * context * flops_per_token / flops; communication: comm_bytes
    / bandwidth (bandwidth = achievable bus bandwidth per device). Above this batch the device is
    compute-bound (communication can hide behind compute); below it, communication-bound.
    overlap="backward" (default) compares with backward only, which is all DDP's gradient
    all-reduce can overlap with; "step" with forward + backward.
    Asymptotically for ddp in bf16: tokens = 4P*(N-1)/N * flops / (bandwidth * 4P) ~ flops / bandwidth.
    """
    per_token = flops_per_token(model_cfg)[overlap]
    return comm_bytes / bandwidth * flops / (per_token * model_cfg.context_length)


def calculate(model_cfg, world_size: int = 8, dtype: str = "bf16", flops: float = 989e12,
              bandwidth: float = 450e9, strategies=None, knobs: dict | None = None) -> dict:
    """Everything the CLI prints, as a dict (bytes, FLOPs, sequences); a row per strategy."""
    params = parameter_counts(model_cfg)
    n = params["total"]
    rows = {}
    for spec in strategy_specs(strategies or list(SPECS), knobs):
        plan = spec.schedule()
        comm = link_bytes(spec, plan, model_cfg, n, dtype, world_size) if plan is not None else None
        rows[spec.name] = {
            "knobs": {k: str(v) for k, v in spec.used_knobs().items()},
            "zero_stage": spec.zero_stage,
            "memory": model_state_bytes(n, dtype, world_size, spec.zero_stage),
            "comm_bytes": comm,
            "comm_s": None if comm is None else comm / bandwidth,
            "compute_bound_batch": None if comm is None else compute_bound_batch(model_cfg, comm, flops, bandwidth),
            "compute_bound_batch_step": None if comm is None else compute_bound_batch(model_cfg, comm, flops,
                                                                                       bandwidth, "step"),
        }
    return {"model": model_cfg.get("name", "?"), "params": params, "dtype": dtype, "world_size": world_size,
            "flops": flops, "bandwidth": bandwidth, "context_length": model_cfg.context_length,
            "flops_per_token": flops_per_token(model_cfg), "bytes_per_param": sum(DTYPE_BYTES[dtype]),
            "strategies": rows}


def _gb(x: float | None) -> str:
    return f"{'-':>9}" if x is None else f"{x / 1e9:9.3f}"


def _num(x: float | None, width: int, decimals: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}.{decimals}f}"


def format_report(r: dict) -> str:
    p = r["params"]
    lines = [
        f"model {r['model']}: {p['total']:,} parameters (lookup {p['lookup']:,}, matmul weights {p['matmul']:,}, "
        f"other {p['other']:,})" + (f"; {p['active']:,} active per token (a mixture of experts)"
                                    if p.get("active", p["total"]) != p["total"] else ""),
        f"dtype {r['dtype']} ({r['bytes_per_param']} bytes/param with Adam: "
        + "/".join(str(b) for b in DTYPE_BYTES[r['dtype']]) + " params/grads/optimizer), "
        f"world_size {r['world_size']}, context {r['context_length']}, "
        f"{r['flops'] / 1e12:g} TFLOP/s, {r['bandwidth'] / 1e9:g} GB/s bus bandwidth per device",
        f"training FLOPs/token: forward {r['flops_per_token']['forward']:.3e}, "
        f"backward {r['flops_per_token']['backward']:.3e}",
        "",
        f"{'strategy':<12} {'ZeRO':>4} {'params GB':>9} {'grads GB':>9} {'optim GB':>9} {'total GB':>9} "
        f"{'comm GB':>9} {'comm ms':>9} {'bound@bwd':>10} {'bound@step':>10}",
    ]
    for name, row in r["strategies"].items():
        m = row["memory"]
        lines.append(f"{name:<12} {row['zero_stage']:>4} {_gb(m['params'])} {_gb(m['grads'])} {_gb(m['optimizer'])} "
                     f"{_gb(m['total'])} {_gb(row['comm_bytes'])} "
                     f"{_num(None if row['comm_s'] is None else row['comm_s'] * 1e3, 9, 3)} "
                     f"{_num(row['compute_bound_batch'], 10, 2)} {_num(row['compute_bound_batch_step'], 10, 2)}")
    lines += ["", "memory: model state per device (no activations); GB = 1e9 bytes. comm: bytes over each "
              "rank's link per step (nccl-tests bus convention), from the strategy's declared schedule ('-': none "
              "declared); powersgd: its compressed steps.",
              "bound@bwd / bound@step: sequences per device above which backward (or the whole step) "
              "takes longer than the communication, i.e. the device is compute-bound.",
              "knobs: each strategy's spec defaults" + "".join(
                  f"; {name} " + ", ".join(f"{k}={v}" for k, v in row["knobs"].items())
                  for name, row in r["strategies"].items() if row["knobs"])]
    return "\n".join(lines)


FLAGS = ("--json", "--sequence-parallel")
"""The options that take no value."""


def _normalize_argv(argv: list[str]) -> list[str]:
    """Accept Hydra-style key=value (model=small world_size=8 model.context_length=512 strategy.comm=...) as
    well as --flags."""
    out = []
    for tok in argv:
        value_of_a_flag = bool(out) and out[-1].startswith("--") and "=" not in out[-1] and out[-1] not in FLAGS
        if tok.startswith("-") or "=" not in tok or value_of_a_flag:  # --bandwidth dp=...,tp=...: the flag's value
            out.append(tok)
        elif tok.startswith("model."):
            out.append(f"--set={tok[len('model.'):]}")
        elif tok.startswith("strategy."):
            out.append(f"--knob={tok[len('strategy.'):]}")
        else:
            key, value = tok.split("=", 1)
            out += [f"--{key.replace('_', '-')}", value]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_lab.calculator", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="a conf/model name (toy, tiny, small, ... 2.7b)")
    parser.add_argument("--world-size", "--world_size", type=int, default=8, help="ranks (sharding degree N)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16",
                        help="bf16 = mixed precision Adam (16 bytes/param), fp32 = everything fp32")
    parser.add_argument("--flops", type=float, default=989e12, help="FLOP/s per device (default: H100 bf16 dense)")
    parser.add_argument("--bandwidth", default="450e9",
                        help="bus bandwidth per device, bytes/s (default: H100 NVLink, 450 GB/s one way); with --tp "
                             "one per axis: dp=3.6e11,tp=1.8e11")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel degree: the mesh report (world_size = dp x tp), per axis")
    parser.add_argument("--sequence-parallel", action="store_true", help="with --tp: norms on sequence shards")
    parser.add_argument("--pp", type=int, default=None,
                        help="pipeline stages: the pipeline report (world_size = pp x dp), per stage")
    parser.add_argument("--cp", type=int, default=None,
                        help="context-parallel degree: the context report (world_size = dp x cp), per implementation")
    parser.add_argument("--cp-ulysses", type=int, default=2, help="with --cp: the hybrid's Ulysses group")
    parser.add_argument("--ep", default=None,
                        help="expert-parallel degrees, comma-separated (8,64): the experts report, for a mixture "
                             "(tiny_moe, small_moe, or a published one: deepseek_v3, mixtral_8x7b, qwen3_235b_a22b)")
    parser.add_argument("--schedule", default="1f1b", help="with --pp: gpipe, 1f1b, interleaved_1f1b, zero_bubble")
    parser.add_argument("--microbatches", type=int, default=None, help="with --pp: default one per stage")
    parser.add_argument("--stages-per-rank", type=int, default=1, help="with --pp: interleaved's virtual stages")
    parser.add_argument("--batch", type=int, default=8, help="with --pp or --cp: the global batch in sequences")
    parser.add_argument("--wire", choices=sorted(DTYPE_BYTES), default=None,
                        help="with --tp: the dtype of gradients, gathered weights and activations on the wire "
                             "(default: --dtype's gradient dtype)")
    parser.add_argument("--phase", choices=("forward", "backward", "step"), default="forward",
                        help="with --tp: the phase whose compute hides its communication (default forward)")
    parser.add_argument("--device-gb", default="80",
                        help="with --tp: device memory in GB (1e9 bytes), or several: 80,95; with --cp: one")
    parser.add_argument("--tokens", type=float, default=0.0,
                        help="with --tp: tokens per device whose activations count in the FSDP memory (default 0); "
                             "with --ep: tokens per rank a step (default 4096)")
    parser.add_argument("--strategy", default=",".join(SPECS),
                        help=f"comma-separated, of {', '.join(SPECS)} (default: all)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a model key, e.g. context_length=512 (or model.context_length=512)")
    parser.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE",
                        help="set a strategy knob on every listed strategy that has it (or strategy.KEY=VALUE)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(_normalize_argv(sys.argv[1:] if argv is None else argv))
    if args.world_size < 1:
        parser.error("world size must be >= 1")
    try:
        if args.ep is not None:
            return _experts(args)
        cfg = load_model_config(args.model, key_values(args.set, "--set"))
        strategies = [s for s in args.strategy.split(",") if s]
        if sum(axis is not None for axis in (args.pp, args.tp, args.cp)) > 1:
            raise ValueError("--pp, --tp and --cp: one axis at a time (each report prices its own)")
        if args.cp is not None:
            return _context(args, cfg)
        if args.pp is not None:
            return _pipeline(args, cfg)
        if args.tp is not None:
            return _mesh(args, cfg, strategy_specs(strategies, key_values(args.knob, "--knob")))
        report = calculate(cfg, args.world_size, args.dtype, args.flops, float(args.bandwidth), strategies,
                           key_values(args.knob, "--knob"))
    except ValueError as exc:
        parser.error(str(exc))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _mesh(args, cfg, specs) -> int:
    """The mesh report (`--tp`), one per strategy."""
    from ddp_lab.analysis.mesh_accounting import format_mesh_report, mesh_accounting, parse_bandwidth

    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    wire = args.wire or ("bf16" if DTYPE_BYTES[args.dtype][1] == 2 else "fp32")
    reports = [mesh_accounting(cfg, args.world_size, args.tp, spec, args.dtype, wire, args.flops,
                               parse_bandwidth(args.bandwidth), args.phase, args.sequence_parallel,
                               tuple(float(g) for g in args.device_gb.split(",")), args.tokens) for spec in specs]
    print(json.dumps(reports, indent=2, default=str) if args.json else "\n\n".join(map(format_mesh_report, reports)))
    return 0


def _experts(args) -> int:
    """The experts report (`--ep`), for a published mixture or one of the lab's."""
    from ddp_lab.analysis.expert_accounting import SHAPES, expert_accounting, format_expert_report, lab_shape

    if args.model in SHAPES:
        shape = SHAPES[args.model]
    else:
        cfg = load_model_config(args.model, key_values(args.set, "--set"))
        if cfg.get("experts") is None:
            raise ValueError(f"--ep: model={args.model} has no experts (a mixture: tiny_moe, small_moe, "
                             f"{', '.join(SHAPES)})")
        shape = lab_shape(cfg)
    eps = [int(e) for e in str(args.ep).split(",") if e]
    report = expert_accounting(shape, eps, int(args.tokens) or 4096, args.dtype, args.flops, float(args.bandwidth))
    print(json.dumps(report, indent=2) if args.json else format_expert_report(report))
    return 0


def _context(args, cfg) -> int:
    """The context report (`--cp`)."""
    from ddp_lab.analysis.context_accounting import context_accounting, format_context_report

    if "num_heads" not in cfg:
        raise ValueError(f"--cp: model={args.model} has no attention to split a sequence over")
    report = context_accounting(cfg, args.world_size, args.cp, args.batch, args.dtype, args.flops,
                                float(args.bandwidth), float(args.device_gb), args.cp_ulysses)
    print(json.dumps(report, indent=2) if args.json else format_context_report(report))
    return 0


def _pipeline(args, cfg) -> int:
    """The pipeline report (`--pp`)."""
    from ddp_lab.analysis.pipeline_accounting import format_pipeline_report, pipeline_accounting

    m = args.microbatches if args.microbatches is not None else args.pp * args.stages_per_rank
    wire = args.wire or ("bf16" if DTYPE_BYTES[args.dtype][1] == 2 else "fp32")
    report = pipeline_accounting(cfg, args.world_size, args.pp, m, args.schedule, args.stages_per_rank, args.batch,
                                 args.flops, wire)
    print(json.dumps(report, indent=2) if args.json else format_pipeline_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
