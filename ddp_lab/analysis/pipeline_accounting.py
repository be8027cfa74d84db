"""The calculator on a pipeline (`--pp`): per stage the parameters, the forward's FLOPs, the activations of one
micro-batch and the most alive at once, the bytes sent per step; the bubble by the published formula and by the
schedule run on paper at the stages' own FLOPs (unequal stages: the embedding and the output head).

    python -m ddp_lab.calculator --model tiny --world-size 2 --pp 2 --microbatches 4 --schedule 1f1b --batch 8

Counted from the model itself (models/facts.py's meta model, its `pp_layers()` chain split as a job splits it,
spec/pipeline.py's `split_blocks`): a stage's parameters are its layers'; its forward FLOPs per token 2 x its
linear layers' weights (attention's score and value products added per block: 4 x context x d_model); its
activations what autograd saves running its layers on one micro-batch (the meta device; fp32 or wider, each
saved tensor counted: an upper bound); a stage rank holds the schedule's micro-batches in flight
(`simulate(...).peak_in_flight`) of its largest chunk's. Sends: an activation after each forward but the last
stage's, a gradient after each backward but the first's, each micro-batch rows x context x d_model in `--wire`.
The step on paper costs each stage's forward its FLOPs over C, the backward twice that (zero bubble's I and W a
half each); communication is free.
"""

from __future__ import annotations

import torch
from torch import nn

from ddp_lab.arithmetic.zero_bytes import DTYPE_BYTES
from ddp_lab.models.facts import counting_saved, meta_model
from ddp_lab.spec.pipeline import (
    bubble_formula,
    schedule_actions,
    schedule_problem,
    simulate,
    split_blocks,
    stage_index,
)


def _stage_layers(module: nn.Module, stages: int) -> list[list[str]]:
    first, blocks, last = module.pp_layers()
    ranges = split_blocks(len(blocks), stages)
    return [(first if s == 0 else []) + [n for b in ranges[s] for n in blocks[b]] + (last if s == stages - 1 else [])
            for s in range(stages)]


def _flops_per_token(module: nn.Module, names: list[str], context: int, blocks: set[str]) -> float:
    flops = 0.0
    for name in names:
        layer = module.get_submodule(name)
        flops += sum(2 * m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear))
        if name in blocks and hasattr(layer, "attn"):
            flops += 4 * context * module.embed.weight.shape[1]
    return flops


def _saved_bytes(module: nn.Module, names: list[str], x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """What autograd saves running `names` in order on `x` (meta), and their output."""
    with counting_saved(module) as saved:
        for name in names:
            x = module.get_submodule(name)(x)
    return int(sum(saved)), x.detach()


def pipeline_accounting(model_cfg, world_size: int, pp: int, microbatches: int, schedule: str = "1f1b",
                        chunks: int = 1, batch: int = 8, flops: float = 989e12, wire: str = "fp32") -> dict:
    """Every figure of the module docstring, per stage and per stage rank. ValueError (one line) where the
    pipeline cannot run."""
    if pp < 2 or world_size % pp:
        raise ValueError(f"--pp must be >= 2 and divide --world-size {world_size}, got {pp}")
    problem = schedule_problem(pp, chunks, schedule, microbatches)
    if problem is not None:
        raise ValueError(problem.replace("parallel.", "--").replace("_", "-"))
    dp = world_size // pp
    if batch % (dp * microbatches):
        raise ValueError(f"--batch {batch} does not divide into {dp} data-parallel ranks x {microbatches} "
                         "micro-batches")
    module = meta_model(model_cfg)
    if not hasattr(module, "pp_layers"):
        raise ValueError(f"model {model_cfg['name']} does not say how its forward runs as a chain (no pp_layers())")
    stages = pp * chunks
    first, blocks, last = module.pp_layers()
    if stages > len(blocks):
        raise ValueError(f"{stages} stages, more than the model's {len(blocks)} blocks")
    layers, rows = _stage_layers(module, stages), batch // dp // microbatches
    context, width = int(model_cfg["context_length"]), module.embed.weight.shape[1]
    block_names = {n for b in blocks for n in b}
    x = torch.zeros(rows, context, dtype=torch.long, device="meta")
    per_stage = []
    for s, names in enumerate(layers):
        saved, x = _saved_bytes(module, names, x)
        per_stage.append({"stage": s, "layers": names,
                          "params": sum(p.numel() for n in names for p in module.get_submodule(n).parameters()),
                          "flops_per_token": _flops_per_token(module, names, context, block_names),
                          "activation_bytes_per_microbatch": saved})
    tokens = rows * context
    costs = [{"F": st["flops_per_token"] * tokens / flops} for st in per_stage]
    for c in costs:
        c.update(B=2 * c["F"], I=c["F"], W=c["F"])
    sim = simulate(schedule, pp, microbatches, chunks, stage_costs=costs)
    equal = simulate(schedule, pp, microbatches, chunks)
    one = tokens * width * DTYPE_BYTES[wire][0]
    ranks = []
    for r in range(pp):
        mine = [per_stage[stage_index(r, c, pp)] for c in range(chunks)]
        sends = sum((a.kind == "F" and stage_index(r, a.chunk, pp) < stages - 1) or
                    (a.kind in ("B", "I") and stage_index(r, a.chunk, pp) > 0)
                    for a in schedule_actions(schedule, pp, microbatches, r, chunks))
        ranks.append({"pp_rank": r, "params": sum(st["params"] for st in mine),
                      "in_flight": sim.peak_in_flight[r],
                      "activation_peak_bytes": sim.peak_in_flight[r] * max(st["activation_bytes_per_microbatch"]
                                                                           for st in mine),
                      "sends": sends, "p2p_bytes": sends * one, "busy_s": sim.busy[r]})
    formula = bubble_formula(schedule, pp, microbatches, chunks)
    return {"model": model_cfg["name"], "world_size": world_size, "pp": pp, "dp": dp, "schedule": schedule,
            "microbatches": microbatches, "stages_per_rank": chunks, "batch": batch, "rows_per_microbatch": rows,
            "flops": flops, "wire": wire, "activation_bytes": one, "per_stage": per_stage, "per_rank": ranks,
            "bubble_formula": formula, "bubble_equal_stages": equal.bubble(), "bubble_at_stage_flops": sim.bubble(),
            "step_s": sim.step}


def format_pipeline_report(r: dict) -> str:
    formula = r["bubble_formula"]
    lines = [f"model {r['model']}: world_size {r['world_size']} = pp {r['pp']} x dp {r['dp']}; {r['schedule']}, "
             f"{r['microbatches']} micro-batches of {r['rows_per_microbatch']} sequences"
             + (f", {r['stages_per_rank']} stages per rank" if r["stages_per_rank"] > 1 else "")
             + f"; C = {r['flops']:.4g} FLOP/s", "",
             "stage  params        fwd FLOP/token  activations/micro-batch  layers"]
    for st in r["per_stage"]:
        shown = st["layers"] if len(st["layers"]) <= 4 else st["layers"][:2] + ["..."] + st["layers"][-1:]
        lines.append(f"{st['stage']:>5}  {st['params']:>12,}  {st['flops_per_token']:>14.4g}  "
                     f"{st['activation_bytes_per_microbatch'] / 2**20:>19.2f} MiB  {', '.join(shown)}")
    lines += ["", "rank  params        in flight  activations peak  sends  p2p per step"]
    for rk in r["per_rank"]:
        lines.append(f"{rk['pp_rank']:>4}  {rk['params']:>12,}  {rk['in_flight']:>9}  "
                     f"{rk['activation_peak_bytes'] / 2**20:>12.2f} MiB  {rk['sends']:>5}  "
                     f"{rk['p2p_bytes'] / 2**20:>8.2f} MiB")
    lines += ["", f"one activation crossing a stage boundary: {r['rows_per_microbatch']} x context x d_model in "
              f"{r['wire']} = {r['activation_bytes'] / 2**20:.3f} MiB",
              "bubble: " + (f"formula {100 * formula:.1f}%, " if formula is not None else "")
              + f"on paper at equal stages {100 * r['bubble_equal_stages']:.1f}%, at the stages' own FLOPs "
              f"{100 * r['bubble_at_stage_flops']:.1f}%; the step's compute on paper {1e3 * r['step_s']:.3g} ms"]
    return "\n".join(lines)
