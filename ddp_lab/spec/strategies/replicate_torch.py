"""`strategy=replicate_torch`: torch's `replicate()` (DDP rebuilt on FSDP2), the second bar for bucketed."""

from __future__ import annotations

from dataclasses import dataclass

from ddp_lab.spec.strategy import StrategySpec


@dataclass
class TorchReplicateSpec(StrategySpec):
    """torch's composable `replicate()` as torch 2.13 builds it on FSDP2
    (torch/distributed/_composable/replicate_with_fsdp.py): every parameter replicated, gradients
    all-reduced by FSDP2's machinery during backward. Beside torch_ddp, the bar for bucketed."""

    _target_: str = "ddp_lab.spec.strategies.replicate_torch.TorchReplicateSpec"
    name: str = "replicate_torch"

    runtime = "ddp_lab.strategies.TorchReplicate"
    mesh_refusal = None
    expert_refusal = ("replicate() reduces every parameter over one mesh; the experts would need their own: not "
                      "built yet")
