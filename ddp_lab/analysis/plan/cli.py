"""`python -m ddp_lab.plan`: which layout for this model, these GPUs and this batch? (docs/plan.md)

    python -m ddp_lab.plan --model llama3_70b --system h100-nvlink --gpus 64 --global-batch 4M --context 8192
    python -m ddp_lab.plan --model medium --system h200 --gpus 8 --global-batch 262144 --top 10 --json plan.json
    python -m ddp_lab.plan --model llama3_8b --system h100-nvlink --gpus 8 --global-batch 1M \\
        --layout dp=2,tp=4,pp=1,cp=1,strategy=fsdp_torch,microbatches=4,checkpointing=full
    python -m ddp_lab.plan --model tiny --set num_layers=8 --set d_model=192 --system this-machine --gpus 8

Models: the lab's (conf/model/; its keys changed with `--set`, which the launch line carries), the published Llama 3
shapes (llama3_8b, llama3_70b, llama3_405b: shapes only, nothing allocated) or a JSON file with a Shape's fields.
Systems: the predictor's (ddp_lab/analysis/predict/systems.py), this-machine (this host's ranks on two emulated nodes,
calibrated: host.py), or one described by `--flops`, `--bandwidth` and `--memory` (a TPU-like chip, its collectives
counted as the calculator counts them: described.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from dataclasses import asdict, replace
from pathlib import Path

from ddp_lab.analysis.plan.described import described
from ddp_lab.analysis.plan.host import HostSystem, calibrated_elsewhere, this_machine
from ddp_lab.analysis.plan.price import CHECKPOINTING, HEADROOM, SCHEDULES, STRATEGIES, Layout, Priced, price
from ddp_lab.analysis.plan.ranges import a_tie, memory_range, said, step_range
from ddp_lab.analysis.plan.search import PlanError, lab_refusal, layout_problem, plan, why_runner_up_lost
from ddp_lab.analysis.plan.shapes import PUBLISHED, Shape, from_conf, with_context
from ddp_lab.analysis.predict.costs import PredictError
from ddp_lab.analysis.predict.systems import SYSTEMS, System, get_system
from ddp_lab.config import key_values

GB = 1e9
DEFAULT_SEQUENCES = 8  # the lab's train.batch_size default (ddp_lab/config.py)
WIDTH = 120  # the terminal's columns the output keeps within
SUFFIX = {"k": 2**10, "m": 2**20, "g": 2**30}  # binary, as batch sizes are: 4M is 512 sequences of 8192
THIS_MACHINE = "this-machine"
LAYOUT_KEYS = {"dp", "tp", "pp", "cp", "strategy", "schedule", "microbatches", "checkpointing", "stages_per_rank"}


def tokens(text: str) -> int:
    """`4M`, `262144`, `1.5k`: a token count (k, M, G binary: 4M = 4 x 2^20)."""
    text = text.strip().lower()
    scale = SUFFIX.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale != 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 4M, 262144)") from None


def load_shape(name: str, model_keys: dict | None = None) -> Shape:
    """The shape of `name`: a published one, a shape's JSON file, or a lab model with `model_keys` (`--set`) changed
    as launch.py's `model.KEY=VALUE` would change them."""
    if model_keys and not in_lab(name):
        raise PlanError(f"--set changes a lab model's keys, not {name}'s: write its shape to a JSON file instead")
    if name in PUBLISHED:
        return PUBLISHED[name]
    if name.endswith(".json"):
        try:
            fields = json.loads(Path(name).read_text())
            return Shape(**{k: fields[k] for k in ("name", "layers", "d_model", "heads", "kv_heads", "d_ff", "vocab",
                                                   "context")}, source=name)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PlanError(f"cannot read model shape {name}: {exc}") from None
    from ddp_lab.config import compose_model

    try:
        shape = from_conf(compose_model(name, model_keys))
    except ValueError as exc:
        if model_keys and not str(exc).startswith("unknown model"):
            raise PlanError(f"--set: {exc}") from None
        raise PlanError(f"{exc}; or one of {', '.join(PUBLISHED)}, or a shape's JSON file") from None
    if model_keys:
        shape = replace(shape, name=f"{name} with {set_keys(model_keys, '')}")
    return shape


def set_keys(model_keys: dict | None, prefix: str = "model.") -> str:
    """`--set`'s keys as launch.py's overrides (`model.num_layers=8 ...`), or as the head line names them."""
    return " ".join(f"{prefix}{key}={value}" for key, value in (model_keys or {}).items())


def parse_layout(text: str, gpus: int) -> Layout:
    fields = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in LAYOUT_KEYS:
            raise PlanError(f"--layout: unknown key {key!r}; keys: {', '.join(sorted(LAYOUT_KEYS))}")
        fields[key] = value if key in ("strategy", "schedule", "checkpointing") else int(value)
    tp, pp, cp = fields.get("tp", 1), fields.get("pp", 1), fields.get("cp", 1)
    fields.setdefault("dp", gpus // (tp * pp * cp))
    # unset micro-batches: one per stage (pp x stages_per_rank), as parallel.microbatches' default is
    fields.setdefault("microbatches", pp * fields.get("stages_per_rank", 1))
    layout = Layout(**fields)
    if layout.gpus != gpus:
        raise PlanError(f"--layout: dp {layout.dp} x tp {tp} x pp {pp} x cp {cp} = {layout.gpus}, not --gpus {gpus}")
    if layout.strategy not in STRATEGIES or layout.schedule not in SCHEDULES or \
            layout.checkpointing not in CHECKPOINTING:
        raise PlanError(f"--layout: strategy one of {', '.join(STRATEGIES)}, schedule one of {', '.join(SCHEDULES)}, "
                        f"checkpointing one of {', '.join(CHECKPOINTING)}")
    return layout


HEADER = (f"{'#':>2} {'dp':>4} {'tp':>3} {'pp':>3} {'cp':>3} {'strategy':<11} {'schedule':<13} {'m':>4} {'ac':<4} "
          f"{'tok/s/GPU':>9} {'MFU':>4} {'step':>6} {'GB':>5} {'bubble':>6} {'tp':>5} {'dp':>5} {'other':>5} "
          "binding")
"""The table's columns, within WIDTH with the longest binding and a dp of 4 digits (16,384 GPUs): the terms are ms
(the head line says so), 5 digits wide up to 99,999 ms."""
SCHEDULE_SHOWN = {"interleaved_1f1b": "interleave", "zero_bubble": "zero_bubble", "gpipe": "gpipe", "1f1b": "1f1b"}
AC_SHOWN = {"none": "none", "selective": "sel", "full": "full"}


def row(i: int, p: Priced) -> str:
    lay, t = p.layout, p.terms
    other = t["recompute"] + t["micro"] + t["p2p"] + t["cp"] + t["optimizer"]
    schedule = (SCHEDULE_SHOWN[lay.schedule] + (f" v{lay.stages_per_rank}" if lay.stages_per_rank > 1 else "")) \
        if lay.pp > 1 else "-"
    return (f"{i:>2} {lay.dp:>4} {lay.tp:>3} {lay.pp:>3} {lay.cp:>3} {lay.strategy:<11} {schedule:<13} "
            f"{lay.microbatches:>4} {AC_SHOWN[lay.checkpointing]:<4} {p.tokens_per_s_per_gpu:>9.0f} {p.mfu:>4.2f} "
            f"{_ms(p.step_ms):>6} {p.memory['total'] / GB:>5.1f} {_ms(t['bubble']):>6} {_ms(t['tp']):>5} "
            f"{_ms(t['dp']):>5} {_ms(other):>5} {p.binding}")


def _ms(value: float) -> str:
    """A term in a table cell: one decimal below 1000 ms, whole milliseconds above."""
    return f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def in_lab(model: str) -> bool:
    """A lab model (conf/model/), which launch.py runs; not a published shape or a shape's JSON file."""
    return not (model in PUBLISHED or model.endswith(".json"))


def launch_line(model: str, lay: Layout, sequences: int, system: System | None = None,
                context: int | None = None, model_keys: dict | None = None) -> str | None:
    """The lab's command line for a layout of a lab model (None for a published shape), carrying every key the
    price depends on: `context` where `--context` set one, the model's keys `--set` changed; on `this-machine`, its
    emulated nodes and link."""
    if not in_lab(model):
        return None
    parts = [f"python launch.py model={model} world_size={lay.gpus} strategy={lay.strategy}",
             f"train.batch_size={sequences}"]
    if model_keys:
        parts.append(set_keys(model_keys))
    if context is not None:
        parts.append(f"model.context_length={context}")
    if isinstance(system, HostSystem) and system.nodes > 1:
        parts.append(f"network=emulated network.nodes={system.nodes} network.gbps={system.gbps:g}")
    if lay.tp > 1:
        parts.append(f"parallel.tp={lay.tp}")
    if lay.cp > 1:
        parts.append(f"parallel.cp={lay.cp} parallel.cp_impl=zigzag")
    if lay.pp > 1:
        parts.append(f"parallel.pp={lay.pp} parallel.pp_schedule={lay.schedule} "
                     f"parallel.microbatches={lay.microbatches}")
        if lay.stages_per_rank > 1:
            parts.append(f"parallel.stages_per_rank={lay.stages_per_rank}")
    elif lay.microbatches > 1:
        parts.append(f"train.grad_accum_steps={lay.microbatches}")
    if lay.checkpointing != "none":
        parts.append(f"train.activation_checkpointing={lay.checkpointing}")
    return " ".join(parts)


def _print_launch(model: str, shape: Shape, layout: Layout, sequences: int, system: System, what: str = "it",
                  context: int | None = None, model_keys: dict | None = None) -> None:
    line = None if shape.ffn else launch_line(model, layout, sequences, system, context, model_keys)  # no tokens
    refused = lab_refusal(layout) if line else None
    if refused:
        print(textwrap.fill(f"launch.py refuses {what}: {refused}", WIDTH))
    elif line:
        print(f"run {what} in the lab (one line, to copy):\n{line}")


def as_json(p: Priced, system: System) -> dict:
    step, memory = step_range(system), memory_range(system)
    return {**asdict(p.layout), "terms_ms": p.terms, "step_ms": p.step_ms, "step_range_ms": step.of(p.step_ms),
            "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
            "tokens_per_s_per_gpu_range": (p.tokens_per_s_per_gpu / step.high, p.tokens_per_s_per_gpu / step.low),
            "range_from": step.source, "mfu": p.mfu, "memory_bytes": p.memory,
            "memory_range_bytes": memory.of(p.memory["total"]), "fits": p.fits,
            "binding": p.binding}


def _print_ranges(what: str, p: Priced, system: System) -> None:
    print(textwrap.fill(f"{what}: " + said(system, p.step_ms, p.tokens_per_s_per_gpu, p.memory["total"] / GB),
                        WIDTH))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ddp_lab.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a lab model, llama3_8b/70b/405b, or a shape's JSON file")
    ap.add_argument("--system", default=None,
                    help=f"one of {', '.join(SYSTEMS)}, {THIS_MACHINE}; or describe one with --flops")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--global-batch", type=tokens, default=None, metavar="TOKENS",
                    help=f"tokens per step (4M, 262144; default: the lab's train.batch_size, {DEFAULT_SEQUENCES} "
                    "sequences of the context)")
    ap.add_argument("--context", type=int, default=None, help="tokens per sequence (default: the model's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="model_keys",
                    help="change a lab model's key, e.g. num_layers=8 (or model.num_layers=8), as launch.py would; "
                         "the launch line carries it")
    ap.add_argument("--memory", type=float, default=None, metavar="GB",
                    help="each GPU's memory (default: the system's)")
    ap.add_argument("--headroom", type=float, default=HEADROOM, help=f"the share of each GPU's memory a layout may "
                    f"fill (default {HEADROOM}: the rest for the allocator's fragments, NCCL's buffers, the context)")
    ap.add_argument("--mfu", type=float, default=None, help="the fraction of peak compute reaches (default: the "
                    "system's assumption)")
    ap.add_argument("--attention-mfu", type=float, default=None, help="the fraction of peak attention's scores "
                    "and weighted sum reach (default: --mfu's; 0.26 against torchtitan's runs: docs/plan_accuracy.md)")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--layout", default=None, help="price one layout: dp=..,tp=..,pp=..,cp=..,strategy=..,"
                    "schedule=..,microbatches=..,checkpointing=..")
    ap.add_argument("--json", default=None, metavar="FILE", help="every ranked layout with its terms (with --layout: "
                    "that one)")
    ap.add_argument("--flops", type=float, default=None, help="a described system: each chip's dense bf16 FLOP/s")
    ap.add_argument("--bandwidth", default=None, help="a described system: each chip's link bytes/s, one value or "
                    "per mesh axis (dp=3.6e11,tp=1.8e11; an axis not named takes the slowest): priced as the "
                    "calculator counts a ring")
    ap.add_argument("--hbm-bandwidth", type=float, default=None, help="a described system: memory bytes/s")
    ap.add_argument("--chips-per-node", type=int, default=4, help="a described system: chips sharing fast links")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except (PlanError, PredictError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run(args) -> int:
    if args.system == THIS_MACHINE:
        system = this_machine(args.gpus)
    elif args.flops is not None:
        if args.bandwidth is None:
            raise PlanError("a described system needs --flops and --bandwidth (and --memory, default 80 GB)")
        system = described(args.flops, args.bandwidth, args.memory, args.hbm_bandwidth, args.chips_per_node)
    else:
        system = get_system(args.system or "")
    try:
        model_keys = {k.removeprefix("model."): v for k, v in key_values(args.model_keys, "--set").items()}
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    if args.context is not None and "context_length" in model_keys:
        raise PlanError("the context twice: give --context or --set context_length, not both")
    shape = with_context(load_shape(args.model, model_keys), args.context)
    if args.global_batch is None:
        args.global_batch = DEFAULT_SEQUENCES * shape.context
    if args.global_batch % shape.context:
        raise PlanError(f"--global-batch {args.global_batch} is not a whole number of {shape.context}-token sequences")
    sequences = args.global_batch // shape.context
    capacity = args.memory * GB if args.memory else None
    head = (f"{shape.name} ({shape.params / 1e9:.2f}B parameters, context {shape.context}) on {args.gpus} x "
            f"{system.name}, {sequences} sequences a step ({args.global_batch} tokens)\npredicted from formulas at MFU "
            f"{system.mfu if args.mfu is None else args.mfu:g} (docs/plan.md); ms per step: the step, the "
            "bubble, tp's and dp's exposed collectives, other = recompute + micro-batches' cost + pipeline sends + "
            "cp + optimizer")
    elsewhere = calibrated_elsewhere(system) if isinstance(system, HostSystem) else None
    head += f"\n{elsewhere}" if elsewhere else ""
    head = "\n".join(textwrap.fill(line, WIDTH) for line in head.splitlines())
    if args.layout:
        layout = parse_layout(args.layout, args.gpus)
        problem = layout_problem(shape, layout, sequences)
        if problem:
            raise PlanError(f"--layout: {problem}")
        p = price(shape, system, layout, sequences, args.mfu, capacity, args.attention_mfu, args.headroom)
        print(head)
        print(HEADER)
        print(row(1, p))
        print(textwrap.fill("terms (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in p.terms.items()), WIDTH))
        print(f"memory per GPU: {p.memory['total'] / GB:.1f} GB of {p.memory['capacity'] / GB:.0f} "
              f"({'fits' if p.fits else 'does not fit'} within {args.headroom:.0%})")
        _print_ranges("with its checks' range", p, system)
        _print_launch(args.model, shape, layout, sequences, system, context=args.context, model_keys=model_keys)
        if args.json:
            Path(args.json).write_text(json.dumps([as_json(p, system)], indent=1))
        return 0
    result = plan(shape, system, args.gpus, sequences, capacity, args.mfu, attention_mfu=args.attention_mfu,
                  headroom=args.headroom, lab=in_lab(args.model))
    if not result.ranked and result.nearest_miss is None and result.dropped:
        raise PlanError(f"launch.py refuses every layout of {args.gpus} GPUs for {shape.name}, e.g. "
                        f"{next(iter(result.dropped))}")
    if not result.ranked:
        miss = result.nearest_miss
        raise PlanError(f"no layout of {args.gpus} GPUs fits {shape.name}: the nearest ({miss.layout.describe()}) "
                        f"needs {miss.memory['total'] / GB:.1f} GB per GPU of {miss.memory['capacity'] / GB:.0f} "
                        f"({args.headroom:.0%} usable)")
    print(head)
    refused = sum(result.dropped.values())
    refusals = f", {refused} refused by launch.py (not ranked)" if refused else ""
    print(textwrap.fill(f"{result.priced} layouts priced{refusals}, {len(result.ranked)} fit; the top "
                        f"{min(args.top, len(result.ranked))} by tokens per second per GPU:", WIDTH))
    print(HEADER)
    for i, p in enumerate(result.ranked[:args.top], 1):
        print(row(i, p))
    best = result.ranked[0]
    _print_ranges("the top pick", best, system)
    if len(result.ranked) > 1:
        runner = result.ranked[1]
        tie = (": inside the pick's range, a tie within what the planner can tell"
               if a_tie(system, best.step_ms, runner.step_ms) else "")
        print(textwrap.fill(why_runner_up_lost(best, runner) + tie, WIDTH))
    _print_launch(args.model, shape, result.ranked[0].layout, sequences, system, "the top pick", args.context,
                  model_keys)
    if args.json:
        Path(args.json).write_text(json.dumps([as_json(p, system) for p in result.ranked], indent=1))
    return 0
