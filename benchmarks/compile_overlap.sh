#!/usr/bin/env bash
# Does a strategy's overlap survive torch.compile? (docs/benchmarks.md, "Overlap under torch.compile"; needs root
# and iproute2 for the emulated nodes.)
#
# bucketed, overlap, zero2, fsdp and torch_ddp, each eager and compiled (train.compile=true, inductor), on 2
# emulated nodes joined by 1 Gbit/s links, one rank per node (every gradient byte crosses the link), the tiny
# Transformer, with profile=true so the traces' overlap stands beside the lab's own. Then one table: step, comm,
# exposed comm, overlap % (the lab's), trace overlap % (torch.profiler's), compile s.
#
#   bash benchmarks/compile_overlap.sh [OUT]        # default OUT: outputs/bench/compile_overlap
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/compile_overlap}
status=0
python launch.py network=emulated network.nodes=2 network.gbps=1 world_size=2 model=tiny logger=none \
    train.steps=14 train.warmup_steps=4 profile=true strategy=bucketed,overlap,zero2,fsdp,torch_ddp \
    train.compile=false,true hydra.sweep.dir="$out" -m || status=1
python -m ddp_lab.report "$out" --columns "step p50,comm p50,exposed p50,overlap %,trace overlap %,compile s" \
    || status=1
exit $status
