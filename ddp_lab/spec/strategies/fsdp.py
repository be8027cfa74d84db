"""`strategy=fsdp`: FSDP (ZeRO stage 3) written by hand."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ddp_lab.spec.choices import Dtype, ShardPolicy
from ddp_lab.spec.schedule import Schedule, ShardedUnits
from ddp_lab.spec.strategies.fsdp_units import plan_units
from ddp_lab.spec.strategy import StrategySpec


@dataclass
class FSDPSpec(StrategySpec):
    """FSDP (ZeRO stage 3) written by hand: parameters, gradients and optimizer state sharded. Units (each
    Transformer block, the embedding, the output head) are all-gathered before their forward (the next one
    prefetched), freed after it (reshard_after_forward) and gathered again for their backward; gradients
    are reduce-scattered per unit during backward. train.precision=bf16/fp16 sets the dtype shards are
    gathered and used in."""

    _target_: str = "ddp_lab.spec.strategies.fsdp.FSDPSpec"
    name: str = "fsdp"
    comm_dtype: Optional[Dtype] = None
    """Dtype gradients are reduced in (unset: fp32)."""
    reshard_after_forward: bool = True
    """Free a unit's gathered parameters after its forward, gather them again for backward."""
    policy: ShardPolicy = ShardPolicy.linear_embedding
    """Which parameters are sharded (the rest are replicated, their gradients all-reduced)."""

    runtime = "ddp_lab.strategies.FSDP"
    mesh_refusal = None
    expert_refusal = ("it shards every parameter over the one data-parallel group; the experts would need units of "
                      "their own on their edp group (as torchtitan gives FSDP2 the experts' own mesh)")
    pipeline_refusal = ("its units free their gathered parameters after each forward and expect that unit's "
                        "backward next, where a pipeline runs several micro-batches' forwards first (measured: the "
                        "second backward finds the storage freed); fsdp_torch shards under every schedule, gathered "
                        "once a step")
    torch_reference = "fsdp_torch"
    zero_stage = 3
    whole_parameter_optimizer = False  # its optimizer updates flat slices: no Muon
    casts_itself = True

    def check_model(self, module) -> None:
        plan_units(module, str(self.policy))  # ValueError when it has nothing to shard

    def schedule(self) -> Schedule:
        return Schedule(update="shard", units=ShardedUnits(str(self.policy), self.reshard_after_forward))
