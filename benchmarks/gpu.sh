#!/usr/bin/env bash
# The checks that need a GPU, on a machine with one (docs/benchmarks.md, "On one GPU"):
#
# 1. Two ranks on one GPU: the lab's refusal before any rank starts (one line), and what NCCL itself says
#    when asked directly (torchrun, two processes on cuda:0).
# 2. The collective benchmark on nccl at world_size=1 (the bus-bandwidth arithmetic at n=1: factor 0 for
#    all-reduce, reduce-scatter and all-gather, 1 for broadcast), beside the same sweep on gloo on the
#    same machine's CPU.
# 3. The sharding ladder at world_size=1 on nccl: the small Transformer on text, every sharded strategy
#    and torch's references, so each strategy's CUDA path runs (its events, its memory census).
#
# Each part runs under `timeout` with a 60 s collective timeout, so a hang on the GPU path costs
# minutes, not the lease: the first try (an H200 lease of 15 minutes) ran past its 9-minute limit with
# nothing back, cause unknown.
#
#   bash benchmarks/gpu.sh [OUT]               # default OUT: outputs/bench/gpu
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/gpu}
mkdir -p "$out"
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name(0))"

echo "== 1. two ranks on one GPU"
python launch.py backend=nccl world_size=2 logger=none && status=1  # must refuse
cat > "$out/two_ranks_one_gpu.py" <<'EOF'
import torch, torch.distributed as dist
dist.init_process_group("nccl", device_id=torch.device("cuda:0"))
x = torch.ones(1 << 20, device="cuda:0")
dist.all_reduce(x)
print(f"rank {dist.get_rank()}: all_reduce on one GPU gave {x[0].item()}", flush=True)
dist.destroy_process_group()
EOF
timeout 120 torchrun --standalone --nproc-per-node 2 "$out/two_ranks_one_gpu.py" 2>&1 | grep -E "rank [01]:|Duplicate|Error|error" | head -5

echo "== 2. collectives $(date +%T)"
ops=(task=allreduce world_size=1 task.op=all_reduce,reduce_scatter,all_gather,broadcast task.size_mb=16,64
     task.iters=20 task.time_budget_s=5 logger=none)
timeout 150 python launch.py "${ops[@]}" backend=nccl backend.timeout_s=60 hydra.sweep.dir="$out/collectives_nccl" -m || status=1
timeout 90 python launch.py "${ops[@]}" backend=gloo backend.timeout_s=60 hydra.sweep.dir="$out/collectives_gloo" -m || status=1

echo "== 3. ladder $(date +%T)"
timeout 240 python launch.py backend=nccl backend.timeout_s=60 world_size=1 data=text model=small train.batch_size=4 train.steps=10 \
    train.warmup_steps=2 train.eval_batches=0 logger=none \
    strategy=bucketed,zero1,zero2,fsdp,hsdp,fsdp_torch,torch_ddp hydra.sweep.dir="$out/ladder" -m || status=1
for sweep in collectives_nccl collectives_gloo ladder; do python -m ddp_lab.report "$out/$sweep" || status=1; done
exit $status
