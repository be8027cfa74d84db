"""The replica map: for each class of parameters, which ranks hold identical copies of it, what its summed gradient
is divided by, and whose copy the construction broadcast keeps.

A strategy used to take one process group for every parameter: its mean divided by that group's size, its
construction broadcast every parameter from the group's first rank. Expert parameters break both silently, since
shapes match and nothing raises: an expert's copies live on its expert-data-parallel group only (the ranks at the
same place of every expert-parallel group), and its gradient already sums the tokens of every rank of its
expert-parallel group (the combine's backward brings them), so the mean over its copies alone is ep times too large;
and a broadcast over the data-parallel group would overwrite expert share k with share 0. torchtitan gives each
parameter its own mesh for the same reason (FSDP2 takes a mesh per module).

So a strategy is handed a `ReplicaMap` (built once per rank by `Parallelism`, ddp_lab/parallel/): the dense class
(every parameter, unless another class claims it: the data-parallel group, divided by its size) and, under expert
parallelism, the experts' class (the expert-data-parallel group, divided by dp x cp: every replica's loss is in
the mean). With one class it is exactly the old single group. A strategy whose spec says it takes a map
(`StrategySpec.expert_refusal is None`) groups what it reduces by class; the others are refused before launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ReplicaClass:
    """One class of parameters: `group` holds identical copies (None: every rank); a summed gradient is divided by
    `divisor` (the ranks whose losses the mean is over, not always the group's size); the construction broadcast
    sends `group`'s rank `source`'s copy."""

    name: str
    group: object
    divisor: int
    source: int = 0


class ReplicaMap:
    """Each parameter's `ReplicaClass`: `dense` unless `claimed` (by the parameter's id) names another."""

    def __init__(self, dense: ReplicaClass, claimed: dict[int, ReplicaClass] | None = None):
        self.dense = dense
        self.claimed = dict(claimed or {})

    @classmethod
    def single(cls, group=None) -> ReplicaMap:
        """One class over `group` (None: every rank), divided by its size: what a strategy always did."""
        size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        return cls(ReplicaClass("dense", group, size))

    def of(self, param: torch.Tensor) -> ReplicaClass:
        return self.claimed.get(id(param), self.dense)

    @property
    def classes(self) -> list[ReplicaClass]:
        """Every class, the dense one first, each once."""
        out = [self.dense]
        for replica in self.claimed.values():
            if all(replica is not seen for seen in out):
                out.append(replica)
        return out

    def split(self, params: Iterable[torch.Tensor]) -> list[tuple[ReplicaClass, list[torch.Tensor]]]:
        """`params` grouped by class (the dense class first, each group in `params`' order); classes with none left
        out. Every rank gets the same classes in the same order, so the collectives pair up."""
        params = list(params)
        return [(c, members) for c in self.classes if (members := [p for p in params if self.of(p) is c])]

    def broadcast(self, module: torch.nn.Module) -> None:
        """Every parameter from its class's source, every buffer from the dense class's: all copies start equal.
        Tied parameters appear once in `parameters()`, so each storage is sent once."""
        from ddp_lab.strategies.rings import global_rank

        with torch.no_grad():
            for replica, tensors in self.split(module.parameters()):
                root = global_rank(replica.group, replica.source)
                for tensor in tensors:
                    dist.broadcast(tensor.data, src=root, group=replica.group)
            root = global_rank(self.dense.group, self.dense.source)
            for tensor in module.buffers():
                dist.broadcast(tensor.data, src=root, group=self.dense.group)
