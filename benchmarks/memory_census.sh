#!/usr/bin/env bash
# Every byte each strategy keeps, on the tiny Transformer at 2 and 4 gloo ranks: every registered
# strategy with its defaults, then PowerSGD compressing from the first step and local SGD with
# DiLoCo's outer step (their kept state exists only then), torch_ddp with gradients copied into its
# buckets (gradient_as_bucket_view=false) beside the default, and zero2's pool. The report's "Model
# state per rank" table has, per job, model state, strategy state, their total and the census of
# every tensor storage alive in the rank after the last step (live tensors): docs/benchmarks.md,
# "Every byte a strategy keeps". Memory only: the step times of these short runs are not the point.
#
#   bash benchmarks/memory_census.sh [OUT]     # default OUT: outputs/bench/memory_census
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/memory_census}
common=(world_size=2,4 train.steps=6 train.warmup_steps=1 logger=none)
status=0
python launch.py -m "${common[@]}" hydra.sweep.dir="$out/defaults" \
    strategy=naive,flat,overlap,bucketed,torch_ddp,zero1,zero1_torch,zero2,fsdp,fsdp_torch,powersgd,local_sgd || status=1
python launch.py -m "${common[@]}" hydra.sweep.dir="$out/powersgd" strategy=powersgd strategy.start_iter=0 || status=1
python launch.py -m "${common[@]}" hydra.sweep.dir="$out/local_sgd" strategy=local_sgd strategy.outer=nesterov || status=1
python launch.py -m "${common[@]}" hydra.sweep.dir="$out/torch_ddp" strategy=torch_ddp \
    strategy.gradient_as_bucket_view=false || status=1
python -m ddp_lab.report "$out" || status=1
exit $status
