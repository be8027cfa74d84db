"""ZeRO stage 1: optimizer state sharded over ranks.

| file | what |
|---|---|
| optimizer.py | `ShardedOptimizer`: the sharded step and its communication |
| ownership.py | which rank owns which parameter (balanced by bytes) |
| checkpoint.py | consolidated `state_dict()` / `load_state_dict()` on any world size |
| strategy.py | `Zero1` (`strategy=zero1`): a gradient-sync wrapper wired to ShardedOptimizer |
| torch_reference.py | `TorchZero1` (`strategy=zero1_torch`): torch DDP + ZeroRedundancyOptimizer |
"""

from ddp_lab.strategies.zero1.optimizer import ShardedOptimizer
from ddp_lab.strategies.zero1.ownership import assign_owners
from ddp_lab.strategies.zero1.strategy import Zero1
from ddp_lab.strategies.zero1.torch_reference import TorchZero1

__all__ = ["ShardedOptimizer", "TorchZero1", "Zero1", "assign_owners"]
