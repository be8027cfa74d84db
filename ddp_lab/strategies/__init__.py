"""Gradient-synchronization strategies as they run in a rank: one file (or folder) each.

What each strategy is (its knobs, its ZeRO stage, its schedule) is its spec's, in
ddp_lab/spec/strategies/ (the table there maps every option to its spec and its class here).

| strategy (`strategy=`) | class | file |
|---|---|---|
| none | NoSync (the floor: no synchronization at all) | no_sync.py |
| naive | NaiveDDP | naive.py |
| flat | FlatDDP | flat.py |
| overlap | OverlapDDP | overlap.py (on overlap_engine.py) |
| bucketed | BucketedDDP, plan_buckets | bucketed.py (on overlap_engine.py) |
| torch_ddp | TorchDDP (torch's DistributedDataParallel) | torch_ddp.py |
| zero1 | Zero1 + ShardedOptimizer | zero1/strategy.py, zero1/optimizer.py |
| zero1_torch | TorchZero1 (torch DDP + ZeroRedundancyOptimizer) | zero1/torch_reference.py |
| zero2 | Zero2 + Zero2Optimizer | zero2.py (on bucketed.py's buckets) |
| fsdp | FSDP (hand-written ZeRO-3) | fsdp/ (unit.py, wrapper.py; its unit plan: spec/strategies/fsdp_units.py) |
| fsdp_torch | TorchFSDP (torch's fully_shard, FSDP2) | fsdp_torch.py |
| hsdp | HSDP (fsdp inside shard groups, replicated across them) | hsdp.py (on fsdp/) |
| powersgd | PowerSGD | powersgd.py (on bucketed.py's buckets) |
| local_sgd | LocalSGD | local_sgd.py |
| local_sgd_torchft | TorchftDiLoCo (torchft's streaming DiLoCo, an optional extra) | local_sgd_torchft.py |
| demo | DeMo (decoupled momentum: top DCT coefficients all-gathered, sign-SGD) | demo.py |
| replicate_torch | TorchReplicate (torch's replicate(), DDP on FSDP2) | replicate_torch.py |
| deepspeed_zero1, _zero2, _zero3 | DeepSpeedZeRO (DeepSpeed's engine, an optional extra) | deepspeed_zero.py |

Shared parts: base.py (the contract every strategy keeps), overlap_engine.py (launching
collectives from backward hooks), collectives.py (the collectives themselves, and the choice of
`backend.collectives`), rings.py (reduce-scatter and all-gather as rings over point-to-point), comm_stats.py (what
a step's communication figures mean and how async collectives are timed), shard_optimizer.py
(what the sharded optimizers of zero1 and zero2 share).

Adding a strategy: docs/strategies.md, "Adding a strategy" (a runtime class, a spec, a YAML).
"""

from ddp_lab.strategies.base import DataParallelBase
from ddp_lab.strategies.bucketed import BucketedDDP, plan_buckets
from ddp_lab.strategies.deepspeed_zero import DeepSpeedZeRO
from ddp_lab.strategies.demo import DeMo
from ddp_lab.strategies.flat import FlatDDP
from ddp_lab.strategies.fsdp import FSDP
from ddp_lab.strategies.fsdp_torch import TorchFSDP
from ddp_lab.strategies.hsdp import HSDP
from ddp_lab.strategies.local_sgd import LocalSGD
from ddp_lab.strategies.local_sgd_torchft import TorchftDiLoCo
from ddp_lab.strategies.naive import NaiveDDP
from ddp_lab.strategies.no_sync import NoSync
from ddp_lab.strategies.overlap import OverlapDDP
from ddp_lab.strategies.powersgd import PowerSGD
from ddp_lab.strategies.replicate_torch import TorchReplicate
from ddp_lab.strategies.torch_ddp import TorchDDP
from ddp_lab.strategies.zero1 import ShardedOptimizer, TorchZero1, Zero1
from ddp_lab.strategies.zero2 import Zero2, Zero2Optimizer

__all__ = ["FSDP", "HSDP", "BucketedDDP", "DataParallelBase", "DeepSpeedZeRO", "DeMo", "TorchReplicate",
           "FlatDDP", "LocalSGD", "NaiveDDP", "NoSync",
           "OverlapDDP", "PowerSGD", "ShardedOptimizer", "TorchDDP", "TorchFSDP", "TorchZero1", "TorchftDiLoCo",
           "Zero1", "Zero2",
           "Zero2Optimizer", "plan_buckets"]
