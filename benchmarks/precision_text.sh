#!/usr/bin/env bash
# Precision and compression on real text, scored by the held-out loss (docs/benchmarks.md, "Precision
# and compression on text").
#
# data=text (the built-in corpus: Python's help() topics as bytes, the last 10% held out), the tiny
# Transformer (vocab 256), 2 gloo ranks, STEPS steps, the validation loss every EVAL_EVERY steps on
# EVAL_BATCHES fixed held-out batches of 8 sequences:
#   bucketed with comm_dtype fp32 / bf16 / fp16 (the fp32 job is the exact reference of every row),
#   bucketed with train.precision=bf16 (autocast compute),
#   powersgd at rank 1 and 4, local_sgd every 4 and 16 steps, plain and with DiLoCo's outer Nesterov;
# then python -m ddp_lab.report over all of it: the accuracy table (final validation loss, its gap to
# the exact run, wire bytes per step, time to the exact run's final validation loss + 5%) and
# report_loss.png (validation loss against wall time and step).
#
#   bash benchmarks/precision_text.sh [OUT]                  # default OUT: outputs/bench/precision_text
#   STEPS=40 EVAL_EVERY=10 bash benchmarks/precision_text.sh /tmp/pt     # a quick check
#
# A sweep with failed jobs still gets its report (failed rows are marked); the script then exits 1.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/precision_text}
steps=${STEPS:-400}
common=(data=text backend=gloo world_size=2 logger=none model=tiny train.steps="$steps" train.warmup_steps=5
        train.eval_every="${EVAL_EVERY:-25}" train.eval_batches="${EVAL_BATCHES:-8}")
status=0

run() {  # run SUBFOLDER OVERRIDES...: one sweep into $out/SUBFOLDER
    local sub=$1; shift
    python launch.py "${common[@]}" "$@" hydra.sweep.dir="$out/$sub" -m || status=1
}

run wire strategy=bucketed strategy.comm_dtype=fp32,bf16,fp16
run compute strategy=bucketed train.precision=bf16
run powersgd strategy=powersgd strategy.rank=1,4
run local_sgd strategy=local_sgd strategy.sync_every=4,16 strategy.outer=none,nesterov
python -m ddp_lab.report "$out" || status=1
exit $status
