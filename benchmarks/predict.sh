#!/usr/bin/env bash
# docs/predict.md's tables: calibrate the step-time model on this machine from a collective sweep and ONE
# profiled run (overlap, tiny, 2 ranks), predict a training sweep it never saw (naive, flat, overlap,
# bucketed at six bucket sizes (the bucket choice is scored against chance over five or more), zero1,
# zero2, local_sgd, powersgd plain and compressed, fsdp at 2 and 4 gloo ranks), score step time and
# exposed comm, and carry the model to named GPU systems.
# Writes OUT/predict.md (the validation table with the machine and commands, the best-bucket check,
# the scale tables) ready to paste into docs/predict.md, and OUT/scale_*.png. About 17 minutes on 2 cores.
#
#   bash benchmarks/predict.sh [OUT]        # default OUT: outputs/bench/predict
#   STEPS=6 SIZES_MB=0.001,1,10 BUCKETS_MB=1,16 STRATEGIES=naive,overlap WORLD_SIZES=2 bash benchmarks/predict.sh /tmp/p
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/predict}
steps=${STEPS:-12}
sizes=${SIZES_MB:-0.001,0.01,0.1,1,10,40}
buckets=${BUCKETS_MB:-1,2,4,8,16,64}
strategies=${STRATEGIES:-naive,flat,overlap,zero1,zero2,local_sgd,powersgd,fsdp}
world_sizes=${WORLD_SIZES:-2,4}
mkdir -p "$out"
common="model=tiny backend=gloo logger=none train.warmup_steps=3"

# each op alone (a barrier before each call); and all-reduces back to back, as naive issues them
python launch.py task=allreduce backend=gloo world_size="$world_sizes" task.op=all_reduce,broadcast,reduce \
    task.size_mb="$sizes" task.time_budget_s=10 logger=none hydra.sweep.dir="$out/collectives/alone" -m
python launch.py task=allreduce backend=gloo world_size="$world_sizes" task.op=all_reduce task.barrier=false \
    task.size_mb="$sizes" task.time_budget_s=10 logger=none hydra.sweep.dir="$out/collectives/back_to_back" -m
# twice the sweep's steps: one profile is the whole calibration, its medians should be steady (the
# profiler records 4 after warm-up, fit prefers the ones it did not)
python launch.py $common train.steps=$((2 * steps)) strategy=overlap world_size=2 profile=true \
    hydra.run.dir="$out/profiled"
python -m ddp_lab.predict fit "$out/collectives" "$out/profiled" -o "$out/model.json"

python launch.py $common train.steps="$steps" strategy="$strategies" world_size="$world_sizes" \
    hydra.sweep.dir="$out/train/strategies" -m
python launch.py $common train.steps="$steps" strategy=bucketed strategy.bucket_mb="$buckets" \
    world_size="$world_sizes" hydra.sweep.dir="$out/train/buckets" -m
# powersgd compressing from the first step (the strategies sweep's start_iter=10 measures plain steps)
python launch.py $common train.steps="$steps" strategy=powersgd strategy.start_iter=0 \
    world_size="$world_sizes" hydra.sweep.dir="$out/train/powersgd" -m
python -m ddp_lab.predict validate "$out/model.json" "$out/train" --markdown "$out/validate.md" | tee "$out/validate.txt"

{
    echo "## Validation on this machine"
    echo
    echo "Machine: $(nproc) CPU cores ($(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)), \
torch $(python -c 'import torch; print(torch.__version__)'), gloo; $(date -u +%Y-%m-%d)."
    echo
    echo '```'
    echo "bash benchmarks/predict.sh $out"
    echo "python -m ddp_lab.predict validate $out/model.json $out/train"
    echo '```'
    echo
    cat "$out/validate.md"
    echo
    echo "Fitted: $(python -c "import json; m=json.load(open('$out/model.json')); c, k = m['compute'], m['contention']; \
print(f\"forward {c['forward_ms']:.1f} ms, backward {c['backward_ms']:.1f} ms of work, optimizer {c['optimizer_ms']:.1f} ms; \
while both run at 2 ranks compute x{k['compute_slowdown']:.2f} and comm x{k['comm_slowdown']:.2f} slower\")")"
    for system in h100-nvlink h100-ib a100-nvlink; do
        echo
        echo "## Scale: $system"
        echo
        python -m ddp_lab.predict scale --system "$system" --model xl --world-size 8,64,512 \
            --strategy naive,flat,overlap,bucketed,zero1,zero2,fsdp --plot "$out/scale_$system.png"
    done
} > "$out/predict.md"
echo "wrote $out/predict.md"
