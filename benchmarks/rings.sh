#!/usr/bin/env bash
# The lab's ring reduce-scatter, all-gather and chain broadcast against gloo's own
# (backend.collectives=ring,native), beside gloo's all-reduce, then the sharding ladder on emulated links
# with the rings (docs/benchmarks.md, "Collectives that cost what the algorithm costs"; parts 1b and 2
# need root and iproute2).
#
# 1. The collective benchmark at 2 and 4 ranks: bus bandwidth of all_reduce, reduce_scatter, all_gather and
#    broadcast at 1, 16 and 64 MiB, each of the last three by both implementations; (a) on the host, (b) on
#    2 emulated nodes (1 or 2 ranks each) with links shaped to 1 and 0.1 Gbit/s.
# 2. The ladder on the same links: bucketed, zero1 (both comm modes), zero2, fsdp, hsdp, fsdp_torch,
#    zero1_torch training the tiny Transformer on text, 8 steps (2 warm-up); comm and step time against
#    bucketed's.
#
#   bash benchmarks/rings.sh [OUT]             # default OUT: outputs/bench/rings
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/rings}
status=0
ops=(task=allreduce task.op=all_reduce,reduce_scatter,all_gather,broadcast task.size_mb=1,16,64 world_size=2,4
     task.iters=10 task.time_budget_s=10 logger=none)
python launch.py "${ops[@]}" backend=gloo backend.collectives=ring,native hydra.sweep.dir="$out/host" -m || status=1
python launch.py "${ops[@]}" backend.collectives=ring,native network=emulated network.nodes=2 network.gbps=1,0.1 \
    hydra.sweep.dir="$out/emulated" -m || status=1
ladder=(data=text model=tiny world_size=4 logger=none train.eval_batches=0 network=emulated network.nodes=2
        network.gbps=1,0.1 train.steps=8 train.warmup_steps=2)
python launch.py "${ladder[@]}" strategy=bucketed,zero1,zero2,fsdp,hsdp,fsdp_torch,zero1_torch hydra.sweep.dir="$out/ladder" -m \
    || status=1
python launch.py "${ladder[@]}" strategy=zero1 strategy.comm=reduce_scatter hydra.sweep.dir="$out/ladder_zero1_rs" -m \
    || status=1
for sweep in host emulated ladder ladder_zero1_rs; do python -m ddp_lab.report "$out/$sweep" || status=1; done
exit $status
