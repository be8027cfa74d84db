"""`strategy=zero1_torch`: torch DDP with torch's ZeroRedundancyOptimizer, the in-run reference for zero1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ddp_lab.spec.buckets import DEFAULT_BUCKET_MB
from ddp_lab.spec.choices import Dtype
from ddp_lab.spec.strategy import StrategySpec, knob_at_least


@dataclass
class TorchZero1Spec(StrategySpec):
    """The in-run reference for zero1: torch's DistributedDataParallel (bucket_mb = its bucket_cap_mb) with
    torch's ZeroRedundancyOptimizer (whole parameters, greedy by size; updated parameters are broadcast by
    their owners after each step). Not replayed by the predictor."""

    _target_: str = "ddp_lab.spec.strategies.zero1_torch.TorchZero1Spec"
    name: str = "zero1_torch"
    bucket_mb: float = DEFAULT_BUCKET_MB
    """DDP's bucket_cap_mb, MiB."""
    gradient_as_bucket_view: bool = True
    """DDP's own knob: gradients as views into DDP's buckets, not a second copy of them."""
    comm_dtype: Optional[Dtype] = None
    """fp16: torch's fp16_compress_hook; bf16: its bf16_compress_hook (CUDA with NCCL 2.10+ only)."""

    runtime = "ddp_lab.strategies.TorchZero1"
    zero_stage = 1

    def check(self) -> None:
        knob_at_least(self, "bucket_mb", 0, strictly=True)

    def torch_comm_hooks(self) -> bool:
        return True
