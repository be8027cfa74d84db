#!/usr/bin/env bash
# Does a strategy's overlap survive torch.compile? (docs/benchmarks.md, "Overlap under torch.compile"; needs root
# and iproute2 for the emulated nodes.)
#
# bucketed, overlap, zero2, fsdp, torch_ddp and fsdp_torch, each eager and compiled (train.compile=true,
# inductor), on 2 emulated nodes joined by 1 Gbit/s links, one rank per node (every gradient byte crosses the
# link), the tiny Transformer, with profile=true so the traces' overlap stands beside the lab's own; then
# bucketed and torch_ddp again at 5 MiB buckets (the tiny model's 33 MiB of gradients in 7 buckets, not 2).
# Then one table: step, forward+backward, comm, exposed comm, overlap % (the lab's), trace overlap %
# (torch.profiler's), compile s.
#
#   bash benchmarks/compile_overlap.sh [OUT]        # default OUT: outputs/bench/compile_overlap
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/compile_overlap}
status=0
common=(network=emulated network.nodes=2 network.gbps=1 world_size=2 model=tiny logger=none train.steps=14
        train.warmup_steps=4 profile=true train.compile=false,true)
python launch.py "${common[@]}" strategy=bucketed,overlap,zero2,fsdp,torch_ddp,fsdp_torch \
    hydra.sweep.dir="$out/default" -m || status=1
python launch.py "${common[@]}" strategy=bucketed,torch_ddp strategy.bucket_mb=5 hydra.sweep.dir="$out/bucket_5" -m \
    || status=1
python -m ddp_lab.report "$out" --columns "step p50,comm p50,exposed p50,overlap %,trace overlap %,compile s" \
    || status=1
exit $status
