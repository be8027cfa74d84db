"""`strategy=hsdp`: hybrid sharding written by hand (fsdp inside shard groups, replicated across them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ddp_lab.spec.schedule import Schedule
from ddp_lab.spec.strategies.fsdp import FSDPSpec
from ddp_lab.spec.strategy import knob_at_least


@dataclass
class HSDPSpec(FSDPSpec):
    """HSDP (hybrid sharding) written by hand: parameters, gradients and optimizer state sharded as fsdp
    shards them, but only within a group of shard_size ranks (by default the ranks of a node), and
    replicated across groups: gradients reduce-scattered inside the group, each shard then all-reduced
    with the same shard of the other groups, parameters all-gathered inside the group. The links between
    nodes carry 1/shard_size of the gradient per step and no parameter."""

    _target_: str = "ddp_lab.spec.strategies.hsdp.HSDPSpec"
    name: str = "hsdp"
    shard_size: Optional[int] = None
    """Ranks per shard group (unset: the ranks of a node); world_size must divide by it."""

    runtime = "ddp_lab.strategies.HSDP"
    mesh_refusal = ("its shard and replica groups are laid over every rank by node; on a mesh, fsdp or fsdp_torch "
                    "shard over the data-parallel axis")
    torch_reference = "fsdp_torch"

    def check(self) -> None:
        knob_at_least(self, "shard_size", 1)  # unset passes

    def shard_ranks(self, world_size: int, ranks_per_node: int) -> int:
        return self.shard_size or ranks_per_node

    def schedule(self) -> Optional[Schedule]:
        return None  # not replayed by the predictor yet: its cross-group all-reduce has no vocabulary
