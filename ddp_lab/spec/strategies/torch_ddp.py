"""`strategy=torch_ddp`: torch's DistributedDataParallel, the in-run reference for the hand-written DDPs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ddp_lab.arithmetic.buckets import DEFAULT_BUCKET_MB
from ddp_lab.spec.choices import Dtype
from ddp_lab.spec.schedule import GradientSync, Schedule
from ddp_lab.spec.strategy import StrategySpec, knob_at_least


@dataclass
class TorchDDPSpec(StrategySpec):
    """torch's DistributedDataParallel (bucket_cap_mb = bucket_mb), the reference in the same sweep."""

    _target_: str = "ddp_lab.spec.strategies.torch_ddp.TorchDDPSpec"
    name: str = "torch_ddp"
    bucket_mb: float = DEFAULT_BUCKET_MB
    """DDP's bucket_cap_mb, MiB."""
    gradient_as_bucket_view: bool = True
    """DDP's own knob: gradients as views into DDP's buckets, not a second copy of them."""
    comm_dtype: Optional[Dtype] = None
    """fp16: torch's fp16_compress_hook; bf16: its bf16_compress_hook (CUDA with NCCL 2.10+ only)."""

    runtime = "ddp_lab.strategies.TorchDDP"
    mesh_refusal = None
    expert_refusal = ("torch's DDP reduces every parameter over one process group; the experts would need to be "
                      "ignored by it and averaged over their edp group apart: not built yet")

    def check(self) -> None:
        knob_at_least(self, "bucket_mb", 0, strictly=True)

    def torch_comm_hooks(self) -> bool:
        return True

    def schedule(self) -> Schedule:
        return Schedule(GradientSync("bucket", "ready", bucket_mb=self.bucket_mb))
