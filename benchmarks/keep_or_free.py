"""Does keeping a buffer between steps pay? zero2's bucket pool and torch DDP's gradient_as_bucket_view, timed.

    python benchmarks/keep_or_free.py                       # tiny model, 2 gloo ranks
    python benchmarks/keep_or_free.py --model small --rounds 4 --steps 3

Each of the four variants keeps something or does not:

- zero2, pool (as shipped): freed gradient buckets kept for the next step's first buckets, at most
  2 x bucket_mb; zero2, no pool (`pool_buckets_mb = 0`): every bucket allocated afresh each step.
- torch_ddp, `gradient_as_bucket_view=true` (as shipped): gradients are views into DDP's buckets;
  `false`: DDP keeps its buckets as a second copy of the gradients and copies into them.

All four are built in one process group from the same seed and trained in turns (a round runs each
variant for `--steps` steps, in a rotated order), so machine noise falls on all of them alike; the
first round is warm-up. A step is timed from a barrier to the end of the optimizer step, on the
slowest rank (the trainer's own `train_step`); the memory each keeps is in docs/benchmarks.md
("Every byte a strategy keeps", `benchmarks/memory_census.sh`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from ddp_lab.check.ranks import run_ranks
from ddp_lab.config import compose_model

VARIANTS = ("zero2, pool (as shipped)", "zero2, no pool", "torch_ddp, gradient_as_bucket_view=true (as shipped)",
            "torch_ddp, gradient_as_bucket_view=false")


def build(variant: str, model_cfg):
    from ddp_lab.models import build_model
    from ddp_lab.strategies import TorchDDP, Zero2

    module = build_model(model_cfg)
    if variant.startswith("zero2"):
        model = Zero2(module)
        if "no pool" in variant:
            model.pool_buckets_mb = 0
    else:
        model = TorchDDP(module, gradient_as_bucket_view="=true" in variant)
    return model, model.make_optimizer(torch.optim.AdamW, lr=1e-3)


def rank_main(rank: int, world_size: int, args) -> dict[str, list[float]]:
    """Every variant's step times on the slowest rank (one thread per rank: run_ranks')."""
    from ddp_lab.rank.step import train_step

    model_cfg = compose_model(args.model)
    built = {}
    for variant in VARIANTS:
        torch.manual_seed(rank)
        built[variant] = build(variant, model_cfg)
    tokens = torch.Generator().manual_seed(rank)
    shape = (args.batch // world_size, model_cfg.context_length + 1)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for round_ in range(args.rounds + 1):
        order = VARIANTS[round_ % len(VARIANTS):] + VARIANTS[:round_ % len(VARIANTS)]
        for variant in order:
            model, optimizer = built[variant]
            for _ in range(args.steps):
                batch = torch.randint(0, model_cfg.vocab_size, shape, generator=tokens)
                dist.barrier()
                start = time.perf_counter()
                train_step(model, optimizer, [(batch[:, :-1], batch[:, 1:])])
                slowest = torch.tensor([(time.perf_counter() - start) * 1e3])
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if round_ > 0:
                    times[variant].append(slowest.item())
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="a conf/model/*.yaml name (a Transformer)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    args = parser.parse_args()
    times = run_ranks(rank_main, args.world_size, args)[0]
    print(f"torch {torch.__version__}, model={args.model}, {args.world_size} gloo ranks, global batch {args.batch}, "
          f"{args.rounds} rounds x {args.steps} steps per variant (after a warm-up round)")
    print("| variant | step p50 ms | step p90 ms | steps |")
    print("|---|---|---|---|")
    for variant, ms in times.items():
        p90 = statistics.quantiles(ms, n=10)[-1] if len(ms) > 1 else ms[0]
        print(f"| {variant} | {statistics.median(ms):.1f} | {p90:.1f} | {len(ms)} |")


if __name__ == "__main__":
    main()
