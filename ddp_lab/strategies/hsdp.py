"""HSDP (hybrid sharding) written by hand: fsdp inside each shard group, data parallelism across groups.

The ranks split into groups of `shard_size` consecutive ranks (by default the ranks of one node, as
torchrun numbers them: node k holds ranks [k·L, (k+1)·L)). Inside a group every unit is sharded as fsdp
shards it over the whole world (fsdp/unit.py): parameters all-gathered before forward and backward,
gradients reduce-scattered after backward, so the fast links inside a node carry the traffic of every
layer. Across groups each rank's shard is replicated: after the reduce-scatter, the ranks that hold the
same shard in each group all-reduce it, so a slow link between nodes carries 1/shard_size of the
gradient once per step, and nothing else. Memory: the ZeRO-3 fraction of the shard group, 1/shard_size.

The cross-group all-reduce runs when the step's gradient sync finishes (after backward, exposed), one
per unit, after that unit's reduce-scatter; replicated parameters (norms, biases) are all-reduced over
every rank as in fsdp.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch import nn

from ddp_lab.strategies.fsdp import FSDP


def shard_layout(world_size: int, shard_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replica groups): consecutive ranks shard, ranks at the same place in each group replicate."""
    groups = world_size // shard_size
    shards = [[g * shard_size + i for i in range(shard_size)] for g in range(groups)]
    replicas = [[g * shard_size + i for g in range(groups)] for i in range(shard_size)]
    return shards, replicas


class HSDP(FSDP):
    """fsdp within groups of `shard_size` ranks, replicated across them (module docstring)."""

    def __init__(self, module: nn.Module, shard_size: int | None = None, process_group=None, **fsdp_knobs):
        if process_group is not None:
            raise ValueError("hsdp lays its shard and replica groups over every rank, not a mesh's data-parallel axis")
        world = dist.get_world_size()
        self.shard_size = shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % self.shard_size:
            raise ValueError(f"hsdp: world_size={world} does not divide into shard groups of {self.shard_size}")
        super().__init__(module, **fsdp_knobs)

    def shard_groups(self):
        shards, replicas = shard_layout(dist.get_world_size(), self.shard_size)
        if len(shards) == 1:
            return None, None  # one shard group: fsdp over the whole world, no group of its own
        shard_group, _ = dist.new_subgroups_by_enumeration(shards)
        replica_group, _ = dist.new_subgroups_by_enumeration(replicas)
        return shard_group, replica_group

    def facts(self) -> dict:
        facts = super().facts()
        facts["fsdp"]["shard_size"] = self.shard_size
        facts["fsdp"]["shard_groups"] = dist.get_world_size() // self.shard_size
        return facts
