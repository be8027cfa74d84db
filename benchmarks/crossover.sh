#!/usr/bin/env bash
# Where compression and hybrid sharding pay: step time against link rate on 2 emulated nodes x 2 ranks,
# and the validation loss each choice reaches (docs/benchmarks.md, "Where compression pays"; needs root
# and iproute2 for part 1).
#
# 1. Step time: data=text, the tiny Transformer, network=emulated network.nodes=2 world_size=4, links
#    at RATES Gbit/s and unshaped, a few steps each (the step time does not need the loss to settle):
#    bucketed (fp32 and bf16 on the wire), powersgd rank 1 and 4 (compressing from the first step: its
#    default start_iter=10 would leave these few steps plain all-reduces), local_sgd every 4 and 16 steps (plain
#    and outer Nesterov: 2 rounds of 16, so the mean step holds its syncs), zero2, fsdp, hsdp, fsdp_torch.
# 3. (below) The runs nearest the crossovers repeated, into $OUT/repeat.
# 2. Validation loss: the same strategies at 4 ranks on the host network for LOSS_STEPS steps. The
#    loss does not depend on the link (the same arithmetic in the same order whatever the rate), so it
#    is measured once, where steps are fast; zero2, fsdp, hsdp and fsdp_torch compute bucketed's
#    average exactly (tests/parity) and are not run again.
#
#   bash benchmarks/crossover.sh [OUT]          # default OUT: outputs/bench/crossover
#   RATES=0.1,1 LOSS_STEPS=50 bash benchmarks/crossover.sh /tmp/x    # a quick check
#   PARTS=steps bash benchmarks/crossover.sh   # part 1 alone (the step times and their picture)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/crossover}
rates=${RATES:-0.1,0.3,1,3},null
parts=${PARTS:-steps,repeat,loss}
status=0
base=(data=text model=tiny world_size=4 logger=none train.eval_batches=0)
link=("${base[@]}" network=emulated network.nodes=2 network.gbps="$rates" train.steps=8 train.warmup_steps=2)
run() {  # run SUBFOLDER OVERRIDES... (only the parts PARTS names)
    local sub=$1; shift
    [[ ",$parts," == *",${sub%%/*},"* ]] || return 0
    python launch.py "$@" hydra.sweep.dir="$out/$sub" -m || status=1
}
run steps/bucketed "${link[@]}" strategy=bucketed strategy.comm_dtype=fp32,bf16
run steps/powersgd "${link[@]}" strategy=powersgd strategy.rank=1,4 strategy.start_iter=0  # compressed from step 0
run steps/sharded "${link[@]}" strategy=zero2,fsdp,hsdp,fsdp_torch
run steps/local_sgd "${link[@]}" train.steps=34 strategy=local_sgd strategy.sync_every=4,16 strategy.outer=none,nesterov
# 3. The runs nearest the crossovers, again, to see whether the ordering holds run to run.
run repeat/bucketed "${link[@]}" network.gbps=1,3,null strategy=bucketed strategy.comm_dtype=fp32,bf16
run repeat/hsdp "${link[@]}" network.gbps=0.3,1,3 strategy=hsdp
loss=("${base[@]}" train.steps="${LOSS_STEPS:-300}" train.warmup_steps=5 train.eval_batches=8 train.eval_every=25)
run loss/bucketed "${loss[@]}" strategy=bucketed strategy.comm_dtype=fp32,bf16
run loss/powersgd "${loss[@]}" strategy=powersgd strategy.rank=1,4
run loss/local_sgd "${loss[@]}" strategy=local_sgd strategy.sync_every=4,16 strategy.outer=none,nesterov
for part in steps loss; do
    [[ ",$parts," == *",$part,"* ]] && { python -m ddp_lab.report "$out/$part" || status=1; }
done
exit $status
