"""`strategy=bucketed`: gradients in buckets, one async all-reduce per bucket as soon as it is full."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ddp_lab.arithmetic.buckets import DEFAULT_BUCKET_MB
from ddp_lab.spec.choices import AllReduce, Dtype
from ddp_lab.spec.schedule import GradientSync, Schedule
from ddp_lab.spec.strategy import StrategySpec, knob_at_least, mesh_keys, require


@dataclass
class BucketedSpec(StrategySpec):
    """Gradients in buckets of at most bucket_mb MiB (reverse parameter order), one async all-reduce per
    bucket as soon as its last gradient is ready; gradients are views into the buckets."""

    _target_: str = "ddp_lab.spec.strategies.bucketed.BucketedSpec"
    name: str = "bucketed"
    bucket_mb: float = DEFAULT_BUCKET_MB
    """Bucket cap in MiB (2^20 bytes, as torch DDP's bucket_cap_mb); a larger tensor gets a bucket of its own."""
    comm_dtype: Optional[Dtype] = None
    """Dtype of gradients on the wire (unset: fp32); the average lands in the fp32 gradient."""
    all_reduce: Optional[AllReduce] = None
    """How each bucket is all-reduced (unset: flat, one all-reduce over every rank). two_level: a ring
    reduce-scatter inside each node, an all-reduce of each shard across nodes, a ring all-gather inside
    the node, as NCCL's trees do across nodes: a node's link carries 2(G-1)/G of the bucket for G nodes
    instead of a flat ring's 2(N-1)/N (2 nodes x 2 ranks: 1.5x fewer bytes)."""
    node_size: Optional[int] = None
    """all_reduce=two_level: ranks per node group, consecutive ranks as torchrun numbers them (unset: a
    node's ranks)."""

    runtime = "ddp_lab.strategies.BucketedDDP"
    mesh_refusal = None
    expert_refusal = None
    torch_reference = "torch_ddp"

    def check(self) -> None:
        knob_at_least(self, "bucket_mb", 0, strictly=True)
        knob_at_least(self, "node_size", 1)
        require(self.node_size is None or self.all_reduce == AllReduce.two_level,
                "strategy.node_size applies to strategy.all_reduce=two_level only")

    def check_world(self, world_size: int, ranks_per_node: int) -> None:
        super().check_world(world_size, ranks_per_node)
        if self.all_reduce == AllReduce.two_level:
            node = self.node_size or ranks_per_node
            require(world_size % node == 0, f"strategy.all_reduce=two_level: world_size={world_size} does not "
                    f"split into node groups of {node} ranks (strategy.node_size)")

    def check_mesh(self, tp: int, pp: int = 1, pp_schedule: str = "1f1b", cp: int = 1) -> None:
        super().check_mesh(tp, pp, pp_schedule, cp)
        require(tp * pp * cp == 1 or self.all_reduce != AllReduce.two_level, f"{mesh_keys(tp, pp, cp)}: "
                "strategy.all_reduce=two_level lays its node groups over every rank, not a mesh's data-parallel "
                "axis: use all_reduce=flat")

    def schedule(self) -> Optional[Schedule]:
        if self.all_reduce == AllReduce.two_level:
            return None  # not replayed by the predictor yet: its levels have no vocabulary
        return Schedule(GradientSync("bucket", "ready", bucket_mb=self.bucket_mb, grads_in_buckets=True))
