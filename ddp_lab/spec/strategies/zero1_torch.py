"""`strategy=zero1_torch`: torch DDP with torch's ZeroRedundancyOptimizer, the in-run reference for zero1."""

from __future__ import annotations

from dataclasses import dataclass

from ddp_lab.spec.strategies.torch_ddp import TorchDDPSpec


@dataclass
class TorchZero1Spec(TorchDDPSpec):
    """The in-run reference for zero1: torch's DistributedDataParallel (bucket_mb = its bucket_cap_mb) with
    torch's ZeroRedundancyOptimizer (whole parameters, greedy by size; updated parameters are broadcast by
    their owners after each step). Not replayed by the predictor."""

    _target_: str = "ddp_lab.spec.strategies.zero1_torch.TorchZero1Spec"
    name: str = "zero1_torch"

    runtime = "ddp_lab.strategies.TorchZero1"
    mesh_refusal = None
    expert_refusal = ("ZeroRedundancyOptimizer shards the optimizer over one process group and its DDP reduces "
                      "every parameter over it; the experts' copies live on another group")
    zero_stage = 1

    def schedule(self) -> None:
        return None  # torch's optimizer broadcasts as it likes: not replayed
