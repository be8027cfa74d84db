"""A strategy's collectives in one training step, as data: what the step-time predictor and the
calculator replay instead of matching strategy names.

A `Schedule` is built by a strategy's spec from its knobs (`StrategySpec.schedule()`), from a small
vocabulary that the strategies here are made of:

- `gradients` (`GradientSync`): how gradients travel during or after backward: one collective per
  gradient tensor, per bucket (arithmetic/buckets.py's plan at `bucket_mb`) or one for all of them; launched
  as soon as the tensor or bucket is ready, or after backward; all-reduced (every rank gets the
  average) or reduce-scattered (each rank only its share: a 1/N slice of each bucket, or the whole
  tensors it owns);
- `update`: which parameters this rank's optimizer updates: all, or its 1/N shard (ZeRO);
- `parameters` (`ParameterSync`): after the optimizer step, the updated parameters shared: each
  owner broadcasting its tensors, an all-gather of every bucket's slices, or an all-reduce of every
  parameter once every `every` steps (local SGD);
- `low_rank` (`LowRank`): gradient matrices sent as PowerSGD's rank-r factors;
- `units` (`ShardedUnits`): parameters sharded too (ZeRO-3), gathered per unit of the strategy's
  own plan before its forward and its backward.

None of it needs torch: a schedule describes, it runs nothing. What each term costs is the
interpreter's business (analysis/predict/interpret.py, on this machine's fitted collectives or a GPU
system's NCCL model; analysis/calculator.py in bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

Group = Literal["tensor", "bucket", "all"]


@dataclass(frozen=True)
class GradientSync:
    """How a step's gradients travel."""

    group: Group
    """One collective per gradient tensor, per bucket of at most `bucket_mb`, or one for all."""
    launch: Literal["ready", "after_backward"]
    """As soon as the tensor (or the bucket's last tensor) is ready in backward, or after backward."""
    op: Literal["all_reduce", "reduce_scatter"] = "all_reduce"
    """all_reduce: every rank gets the average; reduce_scatter: each rank only its share (group="bucket":
    its 1/N slice of each bucket; group="tensor": the tensors it owns, each tensor's average to its owner)."""
    bucket_mb: Optional[float] = None
    """group="bucket": the cap of a bucket, MiB."""
    blocking: bool = False
    """Each call is waited for before the next is issued (timed back to back)."""
    host_copies: bool = False
    """Flattened into a buffer allocated for it, and the average copied back into the gradients."""
    grads_in_buckets: bool = False
    """The gradients are slices of the buckets: forward zeroes the buckets and backward adds each
    gradient into its slice, where autograd would otherwise keep the tensor it computed."""


@dataclass(frozen=True)
class ParameterSync:
    """After the optimizer step: the updated parameters shared between ranks."""

    op: Literal["broadcast", "all_gather", "all_reduce"]
    """broadcast: each owner sends its tensors to every rank, one broadcast each; all_gather: every
    rank's share (slices, or the tensors it owns) to every rank; all_reduce: the parameters averaged."""
    group: Group
    """Per parameter tensor, per gradient bucket (its slices), or all at once."""
    every: int = 1
    """Steps between two syncs (local SGD); 1: after every step."""


@dataclass(frozen=True)
class LowRank:
    """Gradient matrices sent as PowerSGD's rank-`rank` factors P and Q, plain ones (vectors, and
    matrices the factors would not shrink) as they are; the first `start_iter` syncs uncompressed."""

    rank: int
    start_iter: int


@dataclass(frozen=True)
class ShardedUnits:
    """Parameters sharded over ranks (ZeRO-3) in the units of fsdp's plan under `policy`: each unit
    all-gathered before its forward (and, with `reshard_after_forward`, again before its backward),
    its gradients reduce-scattered after its backward."""

    policy: str
    reshard_after_forward: bool


@dataclass(frozen=True)
class Schedule:
    gradients: Optional[GradientSync] = None
    """None: no gradient collective (local SGD averages parameters instead)."""
    update: Literal["all", "shard"] = "all"
    """The parameters this rank's optimizer updates: all of them, or its 1/N shard (ZeRO 1-3)."""
    parameters: Optional[ParameterSync] = None
    low_rank: Optional[LowRank] = None
    units: Optional[ShardedUnits] = None

    def link_bytes(self, grad_bytes: float, param_bytes: float, world_size: int) -> float | None:
        """Bytes over each rank's link per step (nccl-tests' bus convention: bytes / busbw = time) for
        `grad_bytes` of gradients and `param_bytes` of parameters on the wire: all-reduce 2(N-1)/N,
        reduce-scatter and all-gather (N-1)/N, one broadcast per tensor 1 (the root sends it whole), an
        all-reduce every k steps 1/k of one. None for low-rank factors, whose size depends on the
        shapes (the calculator counts them from the model)."""
        phases = self.phase_bytes(grad_bytes, param_bytes, world_size)
        return None if phases is None else sum(phases.values())

    def phase_bytes(self, grad_bytes: float, param_bytes: float, world_size: int) -> dict[str, float] | None:
        """`link_bytes` by the phase of the step they travel in: `forward` (ZeRO-3's gathers before each unit's
        forward), `backward` (its gathers again and its reduce-scatters; a gradient sync, launched during or
        after backward) and `optimizer` (the updated parameters shared after the step)."""
        n = world_size
        out = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        if n == 1:
            return out
        if self.low_rank is not None:
            return None
        factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n,
                  "broadcast": 1.0}
        if self.units is not None:  # gathered for forward (and again for backward), reduce-scattered after
            out["forward"] += factor["all_gather"] * param_bytes
            out["backward"] += factor["all_gather"] * param_bytes * (1 if self.units.reshard_after_forward else 0)
            out["backward"] += factor["reduce_scatter"] * grad_bytes
        if self.gradients is not None:
            out["backward"] += factor[self.gradients.op] * grad_bytes
        if self.parameters is not None:
            out["optimizer"] += factor[self.parameters.op] * param_bytes / self.parameters.every
        return out
