#!/usr/bin/env bash
# docs/predict.md "Held out": calibrate the step-time model from 2-rank measurements ONLY (the collective
# sweep at 2 ranks, one profiled overlap run at 2 ranks), then predict jobs the fit never saw and score them
# per group with `python -m ddp_lab.predict heldout OUT`:
#   heldout/world_sizes   overlap, bucketed, flat, zero2, fsdp at 3 and 4 ranks
#   heldout/strategies    naive, flat, bucketed, zero1, zero2, fsdp at 2 ranks
#   heldout/buckets       bucketed at 4 ranks, 1, 2, 4, 16 and 64 MiB (the bucket choice)
#   heldout/data          bucketed on text and on a token file at 2 ranks (the profile ran synthetic data)
#   link/RATE             2 emulated nodes joined by a RATE Gbit/s link: only a 2-rank collective sweep on the
#                         link is measured there (compute from the host's profile); bucketed and flat at 2
#                         ranks (one per node) and 4 (two per node). Needs root and iproute2.
# The model file is written before any held-out job runs. About 25 minutes on 2 cores.
#
#   bash benchmarks/predict_heldout.sh [OUT]        # default OUT: outputs/bench/heldout
#   STEPS=6 SIZES_MB=0.01,1,10 RATES_GBPS=1 bash benchmarks/predict_heldout.sh /tmp/h     # a quick look
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/heldout}
steps=${STEPS:-12}
sizes=${SIZES_MB:-0.001,0.01,0.1,1,10,40}
rates=${RATES_GBPS:-1,3}
mkdir -p "$out"
# batch 12: divisible by 2, 3 and 4 ranks; the same model everywhere (data=text keeps vocab 10000)
common="model=tiny backend=gloo logger=none train.warmup_steps=3 train.batch_size=12"

# 1. calibration: 2 ranks only
python launch.py task=allreduce backend=gloo world_size=2 task.op=all_reduce,broadcast,reduce \
    task.size_mb="$sizes" task.time_budget_s=5 logger=none hydra.sweep.dir="$out/calibration/collectives/alone" -m
python launch.py task=allreduce backend=gloo world_size=2 task.op=all_reduce task.barrier=false \
    task.size_mb="$sizes" task.time_budget_s=5 logger=none hydra.sweep.dir="$out/calibration/collectives/back_to_back" -m
python launch.py $common train.steps=$((2 * steps)) strategy=overlap world_size=2 profile=true \
    hydra.run.dir="$out/calibration/profiled"
python -m ddp_lab.predict fit "$out/calibration/collectives" "$out/calibration/profiled" -o "$out/model.json"

# 2. held out, on the host
python launch.py $common train.steps="$steps" strategy=overlap,bucketed,flat,zero2,fsdp world_size=3,4 \
    hydra.sweep.dir="$out/heldout/world_sizes" -m
python launch.py $common train.steps="$steps" strategy=naive,flat,bucketed,zero1,zero2,fsdp world_size=2 \
    hydra.sweep.dir="$out/heldout/strategies" -m
python launch.py $common train.steps="$steps" strategy=bucketed strategy.bucket_mb=1,2,4,16,64 world_size=4 \
    hydra.sweep.dir="$out/heldout/buckets" -m
python -c "import numpy as np; np.random.default_rng(0).integers(0, 10000, 2_000_000, dtype=np.uint16).tofile('$out/tokens.bin')"
python launch.py $common train.steps="$steps" strategy=bucketed world_size=2 data=text model.vocab_size=10000 \
    hydra.run.dir="$out/heldout/data/text"
python launch.py $common train.steps="$steps" strategy=bucketed world_size=2 data=tokens data.path="$out/tokens.bin" \
    hydra.run.dir="$out/heldout/data/tokens"

# 3. held out, on emulated links: only the collectives are measured there
for rate in ${rates//,/ }; do
    python launch.py task=allreduce backend=gloo world_size=2 network=emulated network.nodes=2 network.gbps="$rate" \
        task.op=all_reduce task.size_mb="$sizes" task.time_budget_s=5 logger=none \
        hydra.sweep.dir="$out/link/$rate/collectives" -m
    python -m ddp_lab.predict fit "$out/link/$rate/collectives" "$out/calibration/profiled" -o "$out/link/$rate/model.json"
    python launch.py $common network=emulated network.nodes=2 network.gbps="$rate" train.steps="$steps" \
        strategy=bucketed,flat world_size=2,4 hydra.sweep.dir="$out/link/$rate/train" -m
done

python -m ddp_lab.predict heldout "$out" --markdown "$out/heldout.md"
