"""FSDP2 under the lab's pipeline as shipped and as it ran before, beside zero2, timed in one run.

    python benchmarks/fsdp_under_pipeline.py                          # tiny, pp 2 x dp 2, 1F1B over 4 micro-batches
    python benchmarks/fsdp_under_pipeline.py --schedule gpipe --rounds 6
    python benchmarks/fsdp_under_pipeline.py --profile                # where FSDP2's extra time goes (torch.profiler)

Variants, each on its own pp 2 x dp 2 mesh of the same 4 gloo ranks:

- zero2: the bar the planner prices FSDP against;
- fsdp_torch (as shipped): each unit gathered in the step's first forward, kept through every micro-batch's forward
  and backward with gradient sync off, reduce-scattered and resharded once after the schedule, as torch's
  PipelineStage runs an FSDP2 module; from the second step every unit's gather is issued as the step begins
  (`before_pipeline_step`);
- fsdp_torch, reduced in the last backward (before 2026-11-29's change): gathered and kept the same way, but the
  step's last backward ran with sync on, so FSDP2's hooks reduce-scattered inside it, before the input's gradient
  went back to the previous stage;
- fsdp_torch, per micro-batch (before that): FSDP2's defaults under `no_sync()`, each micro-batch's forward and
  backward gathering again.

Built from the same seed and trained in turns (a round runs each variant for `--steps` steps, in a rotated order), so
machine noise falls on all alike; the first round is warm-up. A step is timed from a barrier to the end of the
optimizer step, on the slowest rank. The collectives and bytes each variant issued in a step are its own count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ddp_lab.check.ranks import run_ranks
from ddp_lab.config import compose_model

VARIANTS = ("zero2", "fsdp_torch (as shipped)", "fsdp_torch, reduced in the last backward",
            "fsdp_torch, per micro-batch")


class KeptThroughBackward:
    """The "reduced in the last backward" variant's `no_sync()`: sync off and no reshard after backward, both
    restored on exit, so the backward outside it reduce-scatters in FSDP2's hooks."""

    def __init__(self, module):
        self.module = module

    def __enter__(self):
        self.module.set_requires_gradient_sync(False)
        self.module.set_reshard_after_backward(False)

    def __exit__(self, *exc):
        self.module.set_requires_gradient_sync(True)
        self.module.set_reshard_after_backward(True)


def reduced_in_the_last_backward(model) -> None:
    """`model` (fsdp_torch) as it ran under a pipeline before it reduced after the schedule."""
    kept = []

    def before_pipeline_step():
        if kept:
            for unit in [*model._units, model.module]:
                unit.unshard(async_op=True)
            return
        kept.append(True)
        model.module.set_reshard_after_forward(False)

    model.before_pipeline_step = before_pipeline_step
    model.no_sync = lambda: KeptThroughBackward(model.module)


def build(variant: str, args, model_cfg, world_size: int):
    """(the mesh, the wrapped model, its optimizer, its data) of one variant."""
    from ddp_lab.models import build_model
    from ddp_lab.parallel import Parallelism
    from ddp_lab.rank.data import BatchSource
    from ddp_lab.spec.strategies import SPECS
    from ddp_lab.tasks.train import wrap

    cfg = OmegaConf.create({
        "world_size": world_size, "model": OmegaConf.to_container(model_cfg),
        "train": {"batch_size": args.batch, "seed": 0, "grad_accum_steps": 1},
        "parallel": {"tp": 1, "tp_impl": "lab", "sequence_parallel": False, "tp_inner": True, "pp": 2,
                     "pp_schedule": args.schedule, "pp_impl": "lab", "microbatches": args.microbatches,
                     "stages_per_rank": 1, "stage_layers": None, "cp": 1, "cp_impl": "ring", "cp_ulysses": 2,
                     "ep": 1, "ep_impl": "lab"}})
    parallel = Parallelism(cfg, torch.device("cpu"))
    torch.manual_seed(0)
    module = parallel.apply(build_model(model_cfg))
    spec = parallel.data_parallel(SPECS[variant.split(" ")[0].rstrip(",")]())
    model, optimizer, precision = wrap(spec, module, "fp32", "cpu", 1e-3, 0.0, "adamw", parallel.group())
    if "per micro-batch" in variant:
        model.before_pipeline_step = lambda: None  # FSDP2's defaults: gathered per micro-batch
    if "last backward" in variant:
        reduced_in_the_last_backward(model)
    data = BatchSource(cfg, *parallel.data_shard, torch.device("cpu"), parallel.splits, parallel.columns())
    return parallel, model, optimizer, precision, data


def variants_of(schedule: str) -> tuple:
    """Under zero bubble only zero2 and fsdp_torch as shipped: FSDP2 reducing inside the split backward's halves
    hangs (why it was refused before it reduced after the schedule)."""
    return VARIANTS[:2] if schedule == "zero_bubble" else VARIANTS


def rank_main(rank: int, world_size: int, args) -> dict:
    model_cfg = compose_model(args.model)
    variants = variants_of(args.schedule)
    built = {variant: build(variant, args, model_cfg, world_size) for variant in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    comm: dict[str, dict] = {}
    step = 0
    for round_ in range(args.rounds + 1):
        order = variants[round_ % len(variants):] + variants[:round_ % len(variants)]
        for variant in order:
            parallel, model, optimizer, precision, data = built[variant]
            for _ in range(args.steps):
                batches = list(data.micro_batches(step))
                model.comm.pop()
                dist.barrier()
                start = time.perf_counter()
                parallel.step(model, optimizer, batches, precision=precision)
                slowest = torch.tensor([(time.perf_counter() - start) * 1e3])
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                figures = model.comm.pop()
                parallel.pop()
                if round_ > 0:
                    times[variant].append(slowest.item())
                    comm[variant] = {"collectives": figures.get("collectives"), "bytes": figures.get("comm_bytes")}
                step += 1
    return {"times": times, "comm": comm}


PROFILED = {"gather copy-in": ("fsdp::all_gather_copy_in",), "gather copy-out": ("fsdp::split_with_sizes_copy",),
            "reduce-scatter copy-in": ("fsdp::chunk_cat",),
            "optimizer step": ("Optimizer.step#Zero2Optimizer.step", "Optimizer.step#AdamW.step"),
            "DTensor dispatch": ("PythonSubclass",)}
"""`--profile`'s rows, each the first of its torch.profiler names a variant has: FSDP2's copies around its
collectives (torch's _fully_shard/_fsdp_collectives.py), the optimizer's step (zero2's with its all-gather inside),
and the DTensor dispatch FSDP2's parameters go through (most of it inside its optimizer step)."""


def run_steps(built: tuple, first: int, count: int) -> None:
    """`count` steps of one variant (`build`'s tuple) from step `first`, figures popped and dropped."""
    parallel, model, optimizer, precision, data = built
    for step in range(first, first + count):
        batches = list(data.micro_batches(step))
        dist.barrier()
        parallel.step(model, optimizer, batches, precision=precision)
        model.comm.pop()
        parallel.pop()


def profile_main(rank: int, world_size: int, args) -> dict:
    """ms a step of each `PROFILED` row on this rank, zero2 and fsdp_torch as shipped, over `args.steps` steps
    profiled after as many unprofiled (torch.profiler, CPU)."""
    from torch.profiler import ProfilerActivity, profile

    model_cfg = compose_model(args.model)
    out = {}
    for variant in VARIANTS[:2]:
        built = build(variant, args, model_cfg, world_size)
        run_steps(built, 0, args.steps)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_steps(built, args.steps, args.steps)
        totals = {e.key: e.cpu_time_total / 1e3 / args.steps for e in prof.key_averages()}
        out[variant] = {row: next((totals[name] for name in names if name in totals), 0.0)
                        for row, names in PROFILED.items()}
    return out


def print_profile(args) -> None:
    out = run_ranks(profile_main, 4, args)
    print(f"torch {torch.__version__}, model={args.model}, pp 2 x dp 2 on 4 gloo ranks, {args.schedule} over "
          f"{args.microbatches} micro-batches; ms a step over {args.steps} profiled steps (torch.profiler, CPU), "
          "ranks 0 and 1 run stage 0, ranks 2 and 3 stage 1")
    print("| | " + " | ".join(f"zero2, rank {r} | fsdp_torch, rank {r}" for r in range(4)) + " |")
    print("|---|" + "---|" * 8)
    for row in PROFILED:
        cells = [f"{out[r][v][row]:.1f}" for r in range(4) for v in VARIANTS[:2]]
        print(f"| {row} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="a conf/model/*.yaml name (a Transformer)")
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zero_bubble"])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    parser.add_argument("--profile", action="store_true",
                        help="instead: where FSDP2's extra time goes, per rank (torch.profiler), zero2 beside it")
    args = parser.parse_args()
    if args.profile:
        return print_profile(args)
    out = run_ranks(rank_main, 4, args)
    first = out[0]
    print(f"torch {torch.__version__}, model={args.model}, pp 2 x dp 2 on 4 gloo ranks, {args.schedule} over "
          f"{args.microbatches} micro-batches, global batch {args.batch}; {args.rounds} rounds x {args.steps} steps "
          "per variant (after a warm-up round), the slowest rank's step")
    base = statistics.median(first["times"]["zero2"])
    print("| variant | step p50 ms | step p90 ms | / zero2 | collectives a step (rank 0) | bytes a step (rank 0) |")
    print("|---|---|---|---|---|---|")
    for variant, ms in first["times"].items():
        p90 = statistics.quantiles(ms, n=10)[-1] if len(ms) > 1 else ms[0]
        c = first["comm"][variant]
        print(f"| {variant} | {statistics.median(ms):.1f} | {p90:.1f} | {statistics.median(ms) / base:.2f}x | "
              f"{c['collectives']} | {c['bytes']} |")


if __name__ == "__main__":
    main()
