#!/usr/bin/env bash
# docs/benchmarks.md "Beside DeepSpeed": the ZeRO ladder with DeepSpeed's three stages beside ours and torch's, on
# the small Transformer at 2 gloo ranks (the issue's bar: zero1 and zero2 at or under DeepSpeed's stage 1 and 2
# step time, fsdp at or under stage 3's), one sweep, then the report. Needs the extra:
# pip install --no-build-isolation -e ".[deepspeed]". About 12 minutes on 2 cores.
#
#   bash benchmarks/deepspeed_ladder.sh [OUT]      # default OUT: outputs/bench/deepspeed_ladder
#   MODEL=tiny STEPS=4 bash benchmarks/deepspeed_ladder.sh /tmp/dsl          # a quick look
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/deepspeed_ladder}
model=${MODEL:-small}
steps=${STEPS:-10}
strategies=${STRATEGIES:-bucketed,torch_ddp,replicate_torch,zero1,zero1_torch,deepspeed_zero1,zero2,deepspeed_zero2,fsdp,fsdp_torch,deepspeed_zero3}
status=0
python launch.py model="$model" backend=gloo world_size=2 train.batch_size=4 train.steps="$steps" \
    train.warmup_steps=2 logger=none strategy="$strategies" hydra.sweep.dir="$out" -m || status=1
python -m ddp_lab.report "$out" || status=1
exit $status
