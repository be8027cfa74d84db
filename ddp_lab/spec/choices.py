"""Options of strategy knobs: `str` enums, so Hydra refuses an unknown option before launch and code
compares them with plain strings (the config saved for the ranks holds plain strings)."""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Dtype(Choice):
    """A floating-point format: of compute (train.precision) or of gradients on the wire (comm_dtype)."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class CollectiveOp(Choice):
    """task=allreduce: the collective timed (arithmetic/bandwidth.py has each one's bus factor)."""

    all_reduce = "all_reduce"
    reduce_scatter = "reduce_scatter"
    all_gather = "all_gather"
    broadcast = "broadcast"
    reduce = "reduce"


class AllReduce(Choice):
    """bucketed: how each bucket is all-reduced (ddp_lab/strategies/rings.py)."""

    flat = "flat"
    """One all-reduce over every rank (gloo's ring)."""
    two_level = "two_level"
    """Reduce-scatter inside a node, all-reduce of each shard across nodes, all-gather inside the node."""


class ShardPolicy(Choice):
    """fsdp: which parameters are sharded (ddp_lab/spec/strategies/fsdp_units.py)."""

    linear_embedding = "linear_embedding"
    """Weight matrices of Linear and Embedding layers; norms and biases replicated (CS336's split)."""
    all_params = "all_params"
    """Every parameter of one dimension or more (torch FSDP2's default)."""


class OuterOptimizer(Choice):
    """local_sgd: what is applied to the averaged change of the parameters at each sync."""

    none = "none"
    """Plain parameter averaging."""
    nesterov = "nesterov"
    """SGD with Nesterov momentum on the averaged change, as DiLoCo does."""


class ZeroComm(Choice):
    allreduce_broadcast = "allreduce_broadcast"
    """CS336's ZeRO-1: all-reduce the gradients, each owner broadcasts its updated parameters."""
    reduce_scatter = "reduce_scatter"
    """The ZeRO paper's: reduce-scatter gradients to their owners, all-gather the parameters."""
