#!/usr/bin/env bash
# Optimizer-state sharding on the small Transformer at 2 and 4 gloo ranks: bucketed (no sharding),
# zero1 in both communication modes, and torch's ZeroRedundancyOptimizer (zero1_torch) as the bar.
# The table in docs/benchmarks.md ("ZeRO-1"). About 10 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/zero1}
common=(model=small backend=gloo world_size=2,4 train.batch_size=4 train.steps=10 train.warmup_steps=2 logger=none)
python launch.py "${common[@]}" strategy=bucketed,zero1,zero1_torch hydra.sweep.dir="$out/default" -m
python launch.py "${common[@]}" strategy=zero1 strategy.comm=reduce_scatter hydra.sweep.dir="$out/reduce_scatter" -m
python -m ddp_lab.report "$out"
