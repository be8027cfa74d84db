#!/usr/bin/env bash
# docs/benchmarks.md's collective table, the naive/overlap timeline and the cost model's predicted
# against measured best bucket size. About 20 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench}
python launch.py task=allreduce backend=gloo world_size=2,4,6 task.size_mb=1,10,100,1000 task.time_budget_s=30 \
    logger=none hydra.sweep.dir="$out/allreduce" -m
python -m ddp_lab.report "$out/allreduce"
python launch.py strategy=naive,overlap profile=true train.steps=8 logger=none hydra.sweep.dir="$out/timeline" -m
python -m ddp_lab.report "$out/timeline"
python launch.py strategy=naive,overlap logger=none hydra.sweep.dir="$out/overlap" -m
python launch.py task=allreduce backend=gloo world_size=2 task.size_mb=0.25,1,4,16,64 task.iters=50 \
    logger=none hydra.sweep.dir="$out/link_ws2" -m
python launch.py strategy=bucketed strategy.bucket_mb=0.25,0.5,1,2,5,10,25,50 backend=gloo world_size=2 \
    logger=none hydra.sweep.dir="$out/buckets" -m
python -m ddp_lab.report "$out/buckets" --collectives "$out/link_ws2"
