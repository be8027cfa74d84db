#!/usr/bin/env bash
# Every gradient-sync strategy on the small Transformer (Table 1) at 2 gloo ranks, and torch DDP as
# the bar: the table in docs/benchmarks.md ("Strategies"). Hydra's basic sweeper takes cartesian
# products, so the points are three sweeps run back to back into one folder; the report reads
# them as one. About 15 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/strategies}
common=(model=small world_size=2 backend=gloo train.batch_size=4 train.steps=8 train.warmup_steps=2 logger=none)
python launch.py "${common[@]}" strategy=naive,flat,overlap hydra.sweep.dir="$out/sync" -m
python launch.py "${common[@]}" strategy=bucketed strategy.bucket_mb=1,10,25,100,1000 hydra.sweep.dir="$out/bucketed" -m
python launch.py "${common[@]}" strategy=torch_ddp strategy.bucket_mb=25 hydra.sweep.dir="$out/torch_ddp" -m
python -m ddp_lab.report "$out"
# Where per-call latency dominates: a deep, narrow model with many small gradient tensors
# (24 layers of d_model 64: 171 tensors, 4.5 MB of gradients in all). A minute or two.
python launch.py world_size=2 backend=gloo model=tiny model.d_model=64 model.d_ff=128 model.num_layers=24 \
    model.num_heads=4 model.vocab_size=1000 model.context_length=32 train.batch_size=4 train.steps=20 \
    train.warmup_steps=3 logger=none strategy=naive,flat hydra.sweep.dir="${out}_many_small" -m
