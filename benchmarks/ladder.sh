#!/usr/bin/env bash
# The sharding ladder on the small Transformer at 2 and 4 gloo ranks, one sweep: bucketed (nothing
# sharded), zero1 (optimizer state), zero2 (+ gradients), fsdp and fsdp_torch (+ parameters). Then
# gloo's reduce_scatter, all_reduce and all_gather at the same world sizes, at a 25 MiB bucket and at
# the small model's whole gradient (491 MiB): gloo builds reduce-scatter from all-reduce, which makes
# ZeRO-2/3 look worse here than on nccl. Then the report (training and collective tables, model
# state measured vs the ZeRO paper, the memory-against-step-time picture): docs/benchmarks.md,
# "The sharding ladder".
#
#   bash benchmarks/ladder.sh [OUT]            # default OUT: outputs/bench/ladder
#   MODEL=toy STEPS=4 SIZES_MB=1 STRATEGIES=bucketed,zero1,zero2 bash benchmarks/ladder.sh /tmp/ladder   # a check
#
# A sweep with failed jobs still gets its report (failed rows are marked); the script then exits 1.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/ladder}
model=${MODEL:-small}
strategies=${STRATEGIES:-bucketed,zero1,zero2,fsdp,fsdp_torch}
steps=${STEPS:-10}
sizes=${SIZES_MB:-25,491}
status=0
python launch.py model="$model" backend=gloo world_size=2,4 train.batch_size=4 train.steps="$steps" \
    train.warmup_steps=2 logger=none strategy="$strategies" hydra.sweep.dir="$out/train" -m || status=1
python launch.py task=allreduce backend=gloo world_size=2,4 task.op=reduce_scatter,all_reduce,all_gather \
    task.size_mb="$sizes" task.time_budget_s=30 logger=none hydra.sweep.dir="$out/collectives" -m || status=1
python -m ddp_lab.report "$out" || status=1
exit $status
