#!/usr/bin/env bash
# Precision and compression: what each choice saves on the wire and what it costs in loss, on one
# report (docs/benchmarks.md, "Precision and compression").
#
# 1. The tiny Transformer, 2 gloo ranks, enough steps for the loss to settle: bucketed with
#    comm_dtype fp32 / bf16 / fp16 (the fp32 job is the exact reference), then for each strategy of
#    COMPRESS that exists in conf/strategy/: powersgd at rank 1 and 4, local_sgd every 4 and 16 steps.
# 2. train.precision fp32 / bf16 / fp16 (compute dtype) with bucketed on the toy model: on CPU bf16 and
#    fp16 matmuls are far slower than fp32 at these sizes, so these rows show numerics, not speed.
# 3. python -m ddp_lab.report over both: the accuracy-cost table (final loss, gap to the exact run of
#    the same model, wire bytes per step, time to the exact run's final loss + 5%), report_loss.png.
#
#   bash benchmarks/precision.sh [OUT]                         # default OUT: outputs/bench/precision
#   STEPS=20 PRECISION_STEPS=20 bash benchmarks/precision.sh /tmp/precision        # a quick check
#   COMPRESS="powersgd" GRAD_ERROR=true bash benchmarks/precision.sh               # also measure.grad_error
#
# Knobs (environment): STEPS (tiny, default 300), PRECISION_STEPS (toy, default 300), COMPRESS (default
# "powersgd local_sgd"; missing strategies are skipped with a note), GRAD_ERROR (default false: it adds
# one gradient all-reduce per step, which the step times would include).
# A sweep with failed jobs still gets its report (failed rows are marked); the script then exits 1.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/precision}
steps=${STEPS:-300}
precision_steps=${PRECISION_STEPS:-300}
compress=${COMPRESS:-powersgd local_sgd}
grad_error=${GRAD_ERROR:-false}
common=(backend=gloo world_size=2 logger=none measure.grad_error="$grad_error")
status=0

run() {  # run SUBFOLDER OVERRIDES...: one sweep into $out/SUBFOLDER
    local sub=$1; shift
    python launch.py "${common[@]}" "$@" hydra.sweep.dir="$out/$sub" -m || status=1
}

tiny=(model=tiny train.steps="$steps" train.warmup_steps=5)
run comm_dtype "${tiny[@]}" strategy=bucketed strategy.comm_dtype=fp32,bf16,fp16
for strategy in $compress; do
    if [[ ! -f conf/strategy/$strategy.yaml ]]; then
        echo "note: strategy=$strategy is not in conf/strategy/ (not built yet): its rows are skipped" >&2
        continue
    fi
    case $strategy in
        powersgd) run powersgd "${tiny[@]}" strategy=powersgd strategy.rank=1,4 ;;
        local_sgd) run local_sgd "${tiny[@]}" strategy=local_sgd strategy.sync_every=4,16 ;;
        *) run "$strategy" "${tiny[@]}" strategy="$strategy" ;;
    esac
done
run compute model=toy train.steps="$precision_steps" train.warmup_steps=5 strategy=bucketed \
    train.precision=fp32,bf16,fp16
python -m ddp_lab.report "$out" || status=1
exit $status
