"""BucketedDDP: gradients grouped into buckets of at most `bucket_mb` MiB, one async all-reduce each.

The knob trades the per-call latency OverlapDDP pays once per parameter against overlap: one huge
bucket is FlatDDP (nothing launches until the last gradient), tiny buckets are OverlapDDP.

- The plan (`plan_buckets`) walks `parameters()` in reverse, the order gradients roughly become
  ready, and closes a bucket before it would exceed the cap; a parameter larger than the cap gets
  a bucket of its own. Buckets are also split where dtype or device changes.
- Each bucket is one flat buffer allocated at construction and reused every step (zero2, built on
  this class, allocates them at a step's first training forward and frees them after its sync).
  Gradients are views into it (torch DDP's `gradient_as_bucket_view`): `param.grad` *is* a slice of the bucket,
  autograd accumulates straight into it, and nothing is copied in or out. `zero_grad()` with
  `set_to_none=False` zeroes the slices in place; with `set_to_none=True` the next training
  forward zeroes the bucket and points `.grad` back at its slice, instead of letting autograd
  allocate a fresh gradient that would then be copied in. A `.grad` replaced by hand is copied in.
- A bucket holds parameters of one class of the replica map (strategies/replicas.py), reduced over its group:
  under expert parallelism the experts' buckets go over their expert-data-parallel group.
- Buffers live on the parameters' device at construction: move the model before wrapping it.
- `all_reduce="two_level"` all-reduces each bucket in two levels (rings.py): a reduce-scatter inside
  groups of `node_size` consecutive ranks (a node's, `LOCAL_WORLD_SIZE`, by default), an all-reduce of
  each shard across the groups, an all-gather inside the group; buckets are padded to a multiple of
  `node_size` so each rank's shard is whole. One collective in the comm figures, of the bucket's bytes.
- Hook, ordering, unused-parameter and no_sync rules are in overlap_engine.py.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.arithmetic.buckets import DEFAULT_BUCKET_MB, plan_bucket_indices
from ddp_lab.strategies.collectives import two_level_all_reduce_mean_async
from ddp_lab.strategies.hsdp import shard_layout
from ddp_lab.strategies.overlap_engine import OverlapEngine
from ddp_lab.strategies.replicas import ReplicaMap
from ddp_lab.units import MiB, tensor_bytes


def plan_buckets(params: Sequence[torch.Tensor], bucket_mb: float, replicas: ReplicaMap | None = None
                 ) -> list[list[int]]:
    """Indices into `params`, grouped into buckets in reverse order, each at most `bucket_mb` MiB; a bucket holds
    one class of `replicas` (strategies/replicas.py: experts are reduced over another group than dense weights)."""
    kinds = [(p.dtype, p.device, replicas.of(p).name if replicas is not None else None) for p in params]
    return plan_bucket_indices([tensor_bytes(p) for p in params], kinds, bucket_mb)


def node_groups(node_size: int | None) -> tuple:
    """(this rank's node group, the group of ranks at its place in every node): consecutive ranks form a
    node, as torchrun numbers them; `node_size` unset: this node's ranks (LOCAL_WORLD_SIZE)."""
    world = dist.get_world_size()
    size = node_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % size:
        raise ValueError(f"all_reduce=two_level: world_size={world} does not split into node groups of {size}")
    nodes, across = shard_layout(world, size)
    node_group, _ = dist.new_subgroups_by_enumeration(nodes)
    across_group, _ = dist.new_subgroups_by_enumeration(across)
    return node_group, across_group


class BucketedDDP(OverlapEngine):
    keeps_buffers = True
    """Buckets are allocated once and kept; zero2 (a subclass) frees them after every sync."""

    def __init__(self, module: nn.Module, bucket_mb: float = DEFAULT_BUCKET_MB, comm_dtype: str = "fp32",
                 all_reduce: str = "flat", node_size: int | None = None, process_group=None,
                 replicas: ReplicaMap | None = None):
        if str(all_reduce) == "two_level" and (process_group is not None or replicas is not None):
            raise ValueError("bucketed: all_reduce=two_level lays its node groups over every rank, not a mesh's "
                             "data-parallel axis")
        self._levels = node_groups(node_size) if str(all_reduce) == "two_level" else None
        trainable = [p for p in module.parameters() if p.requires_grad]
        plan = plan_buckets(trainable, bucket_mb, replicas)
        super().__init__(module, [[trainable[i] for i in bucket] for bucket in plan], comm_dtype, process_group,
                         replicas)
        self.bucket_mb = bucket_mb
        multiple = self._pad_multiple()
        self._lengths = [-(-sum(p.numel() for p in unit) // multiple) * multiple for unit in self._units]
        self._bucket_buffers: list[torch.Tensor | None] = [None] * len(self._units)
        self._view_of: dict[int, torch.Tensor] = {}
        if self.keeps_buffers:
            for index in range(len(self._units)):
                self._bucket(index)
        self.bucket_sizes_mb = [n * unit[0].element_size() / MiB for n, unit in zip(self._lengths, self._units)]

    def _pad_multiple(self) -> int:
        """Bucket lengths are rounded up to a multiple of this (zero2: the world size, to shard evenly;
        two_level: the node group's size)."""
        return 1 if self._levels is None else dist.get_world_size(self._levels[0])

    def _launch_unit(self, index: int):
        if self._levels is None:
            return super()._launch_unit(index)
        return two_level_all_reduce_mean_async(self._unit_tensor(index), *self._levels, self.wire_dtype)

    def _bucket(self, index: int) -> torch.Tensor:
        """Bucket `index`'s flat buffer (zeros when new) with a view per parameter in `_view_of`."""
        if self._bucket_buffers[index] is None:
            buffer = self._new_buffer(index)
            offset = 0
            for p in self._units[index]:
                self._view_of[id(p)] = buffer[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            self._bucket_buffers[index] = buffer
        return self._bucket_buffers[index]

    def _new_buffer(self, index: int) -> torch.Tensor:
        """A zeroed flat buffer of bucket `index`'s length (zero2 reuses freed ones)."""
        unit = self._units[index]
        return torch.zeros(self._lengths[index], dtype=unit[0].dtype, device=unit[0].device)

    def kept_tensors(self) -> list[torch.Tensor]:
        """The allocated buckets (the gradients are views into them while they exist)."""
        return [b for b in self._bucket_buffers if b is not None]

    def facts(self) -> dict:
        facts = {"buckets": {"count": len(self.bucket_sizes_mb), "sizes_mb": list(self.bucket_sizes_mb)}}
        if self._levels is not None:
            facts["buckets"]["two_level_node_size"] = dist.get_world_size(self._levels[0])
        return facts

    def forward(self, *args, **kwargs):
        if self.training and torch.is_grad_enabled():
            self._point_grads_at_buckets()
        return super().forward(*args, **kwargs)

    def _point_grads_at_buckets(self) -> None:
        for index in range(len(self._units)):
            self._point_grads(index)

    def _point_grads(self, index: int) -> None:
        """Give autograd a zeroed bucket slice to accumulate into wherever `.grad` is None."""
        unit = self._units[index]
        empty = [p for p in unit if p.grad is None]
        if not empty:
            return
        fresh = self._bucket_buffers[index] is None  # allocated just now: already zeros
        buffer = self._bucket(index)
        if fresh:
            pass
        elif len(empty) == len(unit):
            buffer.zero_()  # the usual case after zero_grad(set_to_none=True): one memset
        else:
            for p in empty:
                self._view_of[id(p)].zero_()
        for p in empty:
            p.grad = self._view_of[id(p)]

    def _stage(self, param: nn.Parameter) -> None:
        self._bucket(self._unit_of[id(param)])
        view = self._view_of[id(param)]
        grad = param.grad
        if grad is None:
            view.zero_()  # no gradient on this rank: contribute zeros
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)  # a tensor that is not the slice (set by hand, or a backward without forward)
        else:
            return  # already the bucket slice: autograd accumulated in place, nothing to copy
        param.grad = view

    def _unit_tensor(self, index: int) -> torch.Tensor:
        return self._bucket(index)
