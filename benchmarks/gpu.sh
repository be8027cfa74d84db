#!/usr/bin/env bash
# The GPU check, one call on one H100 or H200 (docs/benchmarks.md, "On one GPU"): does the lab measure the
# algorithm or itself? Every strategy at world_size=1 on nccl, medium at batch 32 in bf16, beside the floor
# (strategy=none) and torch's references, with the per-collective figures on, and off for every strategy that
# stamps collectives (torch_ddp off is torch's DDP bare); xl's floor, flat and torch_ddp; then one table.
#
# Budget: the whole run in at most GPU_CHECK_BUDGET_S seconds (default 360: the 6 minutes the issue
# allows, leaving a 15-minute lease room for a rerun). A job costs about 13 s of start-up there, so the parts
# run in order of need and each later part runs only while time is left: 1. the medium sweep with figures on;
# 2. figures off; 3. xl (floor, flat, bucketed, torch_ddp); 4. compiled (train.compile=true, inductor): the
# floor, bucketed and torch_ddp for medium and xl; 5. one profiled step each of bucketed, flat and torch_ddp
# (torch.profiler traces with CUDA activity: where the host waits and what it launches); 6. the CUDA tests.
# GPU_CHECK_PARTS (default: all) names the parts to run, e.g. `compiled,xl` on a second call. The table is
# written whatever ran, and every floor job that ran goes into OUT/gpu_compute.json, rows for the
# predictor's measured compute (`python -m ddp_lab.predict record`; copy them into
# ddp_lab/analysis/predict/measured/gpu_compute.json to keep them).
#
#   bash benchmarks/gpu.sh [OUT]               # default OUT: outputs/bench/gpu; the table: OUT/table.md
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/gpu}
budget=${GPU_CHECK_BUDGET_S:-360}
parts=${GPU_CHECK_PARTS:-medium,medium_figures_off,xl,compiled,profiled,tests}
mkdir -p "$out"
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }
status=0
# A GPU image without Hydra: the wheels carried in .whl/ (docs/benchmarks.md, "On one GPU", says how to fetch them)
if ! python -c "import hydra" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name(0))" \
    | tee -a "$out/device.txt"
date -u +%FT%TZ >> "$out/device.txt"

strategies=none,flat,naive,overlap,bucketed,zero1,zero2,fsdp,hsdp,powersgd,local_sgd,demo,torch_ddp,zero1_torch,fsdp_torch,replicate_torch
stamped=overlap,bucketed,zero1,zero2,fsdp,powersgd,torch_ddp   # their collectives carry stamps (events on CUDA)
if python -c "import deepspeed" 2>/dev/null; then strategies=$strategies,deepspeed_zero1,deepspeed_zero2; fi
run=(backend=nccl world_size=1 backend.timeout_s=60 logger=none train.precision=bf16 train.eval_batches=0
     data=synthetic train.steps=10 train.warmup_steps=4)
medium=(model=medium train.batch_size=32)

sweep() {  # NAME SECONDS OVERRIDES...: one Hydra sweep under `timeout`, if the budget still has SECONDS
    local name=$1 need=$2; shift 2
    if [[ ",$parts," != *",$name,"* ]]; then echo "== $name: not asked for (GPU_CHECK_PARTS)"; return; fi
    if (( $(left) < need )); then echo "== $name: skipped, $(left) s left of $budget"; return; fi
    echo "== $name $(date +%T), $(left) s left"
    timeout "$(left)" python launch.py "$@" hydra.sweep.dir="$out/$name" -m || status=1
}

sweep medium 200 "${run[@]}" "${medium[@]}" strategy=$strategies
sweep medium_figures_off 60 "${run[@]}" "${medium[@]}" strategy=$stamped measure.per_collective=false
sweep xl 60 "${run[@]}" model=xl train.batch_size=32 strategy=none,flat,bucketed,torch_ddp
sweep compiled 120 "${run[@]}" model=medium,xl train.batch_size=32 strategy=none,bucketed,torch_ddp train.compile=true
sweep profiled 40 "${run[@]}" "${medium[@]}" strategy=bucketed,flat,torch_ddp profile=true train.steps=6 train.warmup_steps=3

ran=(); for sweep in medium medium_figures_off xl compiled; do [[ -d "$out/$sweep" ]] && ran+=("$out/$sweep"); done
python -m ddp_lab.analysis.gpu_table "${ran[@]}" -o "$out/table.md" || status=1   # whatever ran
for sweep in "${ran[@]}"; do   # the floor jobs, for the predictor's measured compute
    python -m ddp_lab.predict record "$sweep" --table "$out/gpu_compute.json" || true
done

if [[ ",$parts," == *",tests,"* ]] && (( $(left) > 30 )) && python -c "import pytest" 2>/dev/null; then
    echo "== CUDA tests $(date +%T), $(left) s left"
    timeout "$(left)" python -m pytest tests/e2e/test_cuda.py -q -p no:cacheprovider -x 2>&1 | tail -15 || status=1
else
    echo "== CUDA tests: skipped ($(left) s left, or no pytest)"
fi
echo "== done in $(( $(date +%s) - start )) s"
exit $status
