"""`strategy=zero1`: ZeRO stage 1, optimizer state sharded over ranks by whole parameters."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

from ddp_lab.arithmetic.buckets import DEFAULT_BUCKET_MB
from ddp_lab.spec.choices import Choice, Dtype, ZeroComm
from ddp_lab.spec.schedule import GradientSync, ParameterSync, Schedule
from ddp_lab.spec.strategy import StrategySpec, knob_at_least, require


class GradSync(Choice):
    """The strategies zero1 can average its gradients with (strategy.grad_sync)."""

    naive = "naive"
    flat = "flat"
    overlap = "overlap"
    bucketed = "bucketed"
    torch_ddp = "torch_ddp"


UNUSED_WITH_REDUCE_SCATTER = ("bucket_mb", "grad_sync")


@dataclass
class Zero1Spec(StrategySpec):
    """ZeRO stage 1: gradients averaged by `grad_sync`, optimizer state sharded over ranks by whole
    parameters (ShardedOptimizer). comm=allreduce_broadcast: grad_sync all-reduces the gradients and each
    owner broadcasts its updated parameters (1.5x an all-reduce's bytes over each link: on gloo the lab's chain
    broadcasts, backend.collectives). comm=reduce_scatter: ZeRO-1
    proper, reduce-scatter of gradients + all-gather of parameters (one all-reduce's bytes; grad_sync and
    bucket_mb unused)."""

    _target_: str = "ddp_lab.spec.strategies.zero1.Zero1Spec"
    name: str = "zero1"
    bucket_mb: float = DEFAULT_BUCKET_MB
    """Bucket cap in MiB of grad_sync, where it has buckets (bucketed, torch_ddp)."""
    grad_sync: GradSync = GradSync.bucketed
    """The strategy that averages the gradients (comm=allreduce_broadcast)."""
    comm: ZeroComm = ZeroComm.allreduce_broadcast
    """The communication pattern of the sharded optimizer."""
    comm_dtype: Optional[Dtype] = None
    """Dtype of gradients on the wire (unset: fp32); the average lands in the fp32 gradient."""

    runtime = "ddp_lab.strategies.Zero1"
    mesh_refusal = None
    expert_refusal = ("its optimizer shards every parameter's state over the one data-parallel group, and an "
                      "expert's copies live on its own (edp) group, to be sharded there")
    torch_reference = "zero1_torch"
    zero_stage = 1

    def check(self) -> None:
        knob_at_least(self, "bucket_mb", 0, strictly=True)
        if self.comm == ZeroComm.reduce_scatter:
            defaults = {f.name: f.default for f in fields(self)}
            for knob in UNUSED_WITH_REDUCE_SCATTER:  # the default may stay; another value would be ignored
                require(getattr(self, knob) == defaults[knob],
                        f"strategy.{knob}={getattr(self, knob)} has no effect with strategy.comm=reduce_scatter "
                        f"(strategy={self.name} ignores it in that mode): leave it out")

    def used_knobs(self) -> dict:
        knobs = self.knobs()
        if self.comm == ZeroComm.reduce_scatter:
            return {k: v for k, v in knobs.items() if k not in UNUSED_WITH_REDUCE_SCATTER}
        return knobs

    def grad_sync_spec(self) -> StrategySpec | None:
        """The spec of the strategy that averages the gradients; None with comm=reduce_scatter."""
        if self.comm == ZeroComm.reduce_scatter:
            return None
        from ddp_lab.spec.strategies import SPECS

        cls = SPECS[str(self.grad_sync)]
        knobs = {k: v for k, v in (("bucket_mb", self.bucket_mb), ("comm_dtype", self.comm_dtype))
                 if k in {f.name for f in fields(cls)}}
        return cls(**knobs)

    def torch_comm_hooks(self) -> bool:
        sync = self.grad_sync_spec()
        return sync is not None and sync.torch_comm_hooks()

    def schedule(self) -> Schedule:
        sync = self.grad_sync_spec()
        if sync is None:  # each parameter's gradient averaged onto its owner, updated parameters gathered back
            return Schedule(GradientSync("tensor", "after_backward", op="reduce_scatter"), update="shard",
                            parameters=ParameterSync("all_gather", "tensor"))
        return replace(sync.schedule(), update="shard", parameters=ParameterSync("broadcast", "tensor"))
