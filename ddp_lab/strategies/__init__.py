"""Gradient-synchronization strategies, one file each.

| strategy (`strategy=`) | class | file |
|---|---|---|
| naive | NaiveDDP | naive.py |
| flat | FlatDDP | flat.py |
| overlap | OverlapDDP | overlap.py (+ hooked.py, inflight.py) |
| bucketed | BucketedDDP, plan_buckets | bucketed.py (+ hooked.py, inflight.py) |
| torch_ddp | TorchDDP (torch's DistributedDataParallel) | torch_ddp.py |
| zero1, zero1_torch | ShardedOptimizer (+ a grad_sync wrapper) | sharded_optimizer.py, zero1.py |

`Strategy` (strategy.py) is what the YAML instantiates; `DataParallelBase` (base.py) is the shared
wrapper contract.
"""

from ddp_lab.strategies.base import DataParallelBase
from ddp_lab.strategies.bucketed import BucketedDDP, plan_buckets
from ddp_lab.strategies.flat import FlatDDP
from ddp_lab.strategies.naive import NaiveDDP
from ddp_lab.strategies.overlap import OverlapDDP
from ddp_lab.strategies.sharded_optimizer import ShardedOptimizer
from ddp_lab.strategies.strategy import Strategy
from ddp_lab.strategies.torch_ddp import TorchDDP

__all__ = ["BucketedDDP", "DataParallelBase", "FlatDDP", "NaiveDDP", "OverlapDDP", "ShardedOptimizer", "Strategy", "TorchDDP", "plan_buckets"]
