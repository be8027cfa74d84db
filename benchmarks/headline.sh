#!/usr/bin/env bash
# The headline sweep, exactly as users type it (default model: tiny, 2 gloo ranks), with W&B off
# so the figures are the code's. A few minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/headline}
python launch.py strategy=bucketed strategy.bucket_mb=1,10,100,1000 logger=none hydra.sweep.dir="$out" -m
python -m ddp_lab.report "$out"
