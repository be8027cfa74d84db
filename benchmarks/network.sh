#!/usr/bin/env bash
# The emulated network's links, measured (docs/benchmarks.md, "Emulated nodes: what the links deliver"; needs root and
# iproute2).
#
# 1. The collective benchmark on 2 emulated nodes: all_reduce of 1, 10 and 100 MiB at 2 ranks (one per
#    node: every byte crosses a link) and 4 ranks (two per node), links shaped to 0.1 and 1 Gbit/s and
#    unshaped. busbw against the link rate says how much of it a large message gets.
# 2. bucketed training of the tiny Transformer at 4 ranks on 2 nodes at the same rates: its comm time
#    moves with the link as the bytes and the rate say.
#
#   bash benchmarks/network.sh [OUT]             # default OUT: outputs/bench/network
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/network}
status=0
common=(network=emulated network.nodes=2 network.gbps=0.1,1,null logger=none)
python launch.py "${common[@]}" task=allreduce world_size=2,4 task.size_mb=1,10,100 task.iters=5 \
    task.warmup_iters=1 hydra.sweep.dir="$out/allreduce" -m || status=1
python launch.py "${common[@]}" world_size=4 model=tiny strategy=bucketed train.steps=10 train.warmup_steps=2 \
    hydra.sweep.dir="$out/bucketed" -m || status=1
python -m ddp_lab.report "$out" || status=1
exit $status
