"""`strategy=fsdp_torch`: torch's fully_shard (FSDP2) on fsdp's units, the bar for fsdp."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ddp_lab.spec.choices import Dtype
from ddp_lab.spec.strategies.fsdp_units import plan_units
from ddp_lab.spec.strategy import StrategySpec, knob_at_least, mesh_keys, require


@dataclass
class TorchFSDPSpec(StrategySpec):
    """The bar for fsdp: torch's fully_shard (FSDP2) on fsdp's units (each Transformer block, the embedding,
    the output head, then the root) with fsdp's knobs: reshard_after_forward, and train.precision=bf16/fp16
    as MixedPrecisionPolicy(param_dtype=...). Not replayed by the predictor: FSDP2 schedules its own
    prefetches and copies."""

    _target_: str = "ddp_lab.spec.strategies.fsdp_torch.TorchFSDPSpec"
    name: str = "fsdp_torch"
    comm_dtype: Optional[Dtype] = None
    """MixedPrecisionPolicy(reduce_dtype=...): the dtype gradients are reduce-scattered in (unset: fp32)."""
    reshard_after_forward: bool = True
    """Free a unit's gathered parameters after its forward, gather them again for backward."""
    shard_size: Optional[int] = None
    """Unset: every rank shards (a 1-D mesh). Set: a 2-D mesh (replicate x shard), FSDP2's hybrid
    sharding, the bar for hsdp; world_size must divide by it."""

    runtime = "ddp_lab.strategies.TorchFSDP"
    mesh_refusal = None
    expert_refusal = ("FSDP2 is wrapped over one mesh; the experts would need fully_shard on their own edp mesh, as "
                      "torchtitan does: not built yet")
    zero_stage = 3
    whole_parameter_optimizer = False  # its optimizer updates flat slices: no Muon
    casts_itself = True

    def check(self) -> None:
        knob_at_least(self, "shard_size", 1)  # unset passes

    def check_mesh(self, tp: int, pp: int = 1, pp_schedule: str = "1f1b", cp: int = 1) -> None:
        super().check_mesh(tp, pp, pp_schedule, cp)
        require(tp * pp * cp == 1 or self.shard_size is None, f"{mesh_keys(tp, pp, cp)}: strategy.shard_size "
                "(FSDP2's hybrid sharding) lays its own 2-D mesh over every rank: on a mesh fsdp_torch shards over "
                "the data-parallel axis")

    def shard_ranks(self, world_size: int, ranks_per_node: int) -> int:
        return self.shard_size or world_size

    def check_model(self, module) -> None:
        plan_units(module)  # fsdp's units under its default policy: ValueError when nothing is sharded
