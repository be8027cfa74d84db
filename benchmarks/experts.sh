#!/usr/bin/env bash
# The experiments of docs/experts.md, one sweep each, on this machine (2 cores: nothing else may run meanwhile):
#   dense    tiny against tiny_moe (equal active FLOPs), 100 steps of real text: step and loss
#   ep       ep 1, 2, 4 on the same 4 ranks: step, the all-to-all's bytes and time, the load, expert memory
#   impl     ep_impl lab beside torch at ep 2 and 4
#   balance  aux_loss, bias, none at ep 4 over 100 steps of real text: the busiest expert per step, the loss
#   bias_rate the aux-loss-free bias at DeepSeek-V3's rate (0.001) and faster, the same 100 steps
#   capacity capacity factor 1.0, 1.25, 2 and dropless at ep 2: dropped share, step, loss
#   network  ep 1, 2 (inside a node) and 4 (across) over two emulated nodes joined by 1 Gbit/s (root)
# Each writes OUT/NAME (a Hydra sweep) and its report; `bash benchmarks/experts.sh OUT [NAMES...]`.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench/experts}
shift || true
names=${*:-dense ep impl balance bias_rate capacity network}
common=(logger=none)
for name in $names; do
    case $name in
        dense) args=(model=tiny,tiny_moe world_size=2 data=text train.steps=100 train.eval_every=25) ;;
        ep) args=(model=tiny_moe world_size=4 parallel.ep=1,2,4) ;;
        impl) args=(model=tiny_moe world_size=4 parallel.ep=2,4 parallel.ep_impl=lab,torch) ;;
        balance) args=(model=tiny_moe world_size=4 parallel.ep=4 model.balance=aux_loss,bias,none data=text
                       train.steps=100 train.eval_every=25) ;;
        bias_rate) args=(model=tiny_moe world_size=4 parallel.ep=4 model.balance=bias model.bias_rate=0.001,0.01,0.05
                         data=text train.steps=100 train.eval_every=25) ;;
        capacity) args=(model=tiny_moe world_size=4 parallel.ep=2 model.capacity_factor=1.0,1.25,2.0,null) ;;
        network) args=(model=tiny_moe world_size=4 parallel.ep=1,2,4 network=emulated network.nodes=2
                       network.gbps=1) ;;
        *) echo "unknown experiment $name" >&2; exit 2 ;;
    esac
    echo "== $name: python launch.py ${args[*]} -m"
    start=$(date +%s)
    python launch.py "${args[@]}" "${common[@]}" "hydra.sweep.dir=$out/$name" -m > "$out.$name.log" 2>&1
    echo "   exit $? in $(( $(date +%s) - start )) s"
    python -m ddp_lab.report "$out/$name" > /dev/null 2>&1
done
