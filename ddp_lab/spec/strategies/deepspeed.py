"""`strategy=deepspeed_zero1`, `deepspeed_zero2`, `deepspeed_zero3`: DeepSpeed's ZeRO engine, the bar users bring.

One option per stage, not one option with a stage knob: a stage is what the memory accounting, the
pre-launch estimate and the ladder read (`zero_stage`, a class fact of every spec), and a sweep
`strategy=zero1,deepspeed_zero1,zero2,deepspeed_zero2,fsdp,deepspeed_zero3 -m` then puts each beside
ours with nothing to set per option. DeepSpeed is an optional extra (`pip install -e ".[deepspeed]"`):
without it a run is refused before launch, in one line; specs import nothing of it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from ddp_lab.arithmetic.buckets import DEFAULT_BUCKET_MB
from ddp_lab.spec.strategy import StrategySpec, knob_at_least, require

INSTALL = 'pip install --no-build-isolation -e ".[deepspeed]"'


@dataclass
class DeepSpeedSpec(StrategySpec):
    """DeepSpeed's ZeRO engine (`deepspeed.initialize`) around the model and the trainer's AdamW, driven by
    ddp-lab's train loop; fp32, no gradient accumulation (its stage 2 and 3 refuse no_sync)."""

    bucket_mb: float = DEFAULT_BUCKET_MB
    """DeepSpeed's reduce_bucket_size and allgather_bucket_size (stage 3: stage3_prefetch_bucket_size), given in
    MiB here and passed in fp32 elements (MiB / 4 bytes), so a bucket holds what bucketed's holds."""
    overlap_comm: bool = False
    """DeepSpeed's overlap_comm: reduce on a side stream (async on CPU) instead of blocking in the hook."""

    runtime = "ddp_lab.strategies.DeepSpeedZeRO"
    mesh_refusal = "DeepSpeed's engine builds its data-parallel groups over every rank itself"
    compile_refusal = ("DeepSpeed's engine runs the model itself (it has its own compile option, not torch.compile "
                       "of the module)")
    own_checkpoint = "deepspeed"  # its engine's save_checkpoint: its flat partitions are no DCP pieces
    whole_parameter_optimizer = False  # its optimizer updates flat slices: no Muon

    def check(self) -> None:
        knob_at_least(self, "bucket_mb", 0, strictly=True)

    def knobs(self) -> dict:
        return {**super().knobs(), "stage": self.zero_stage}

    def used_knobs(self) -> dict:
        return StrategySpec.knobs(self)  # the stage is the option's name

    def check_run(self, precision: str, grad_accum_steps: int) -> None:
        require(importlib.util.find_spec("deepspeed") is not None,
                f"strategy={self.name} needs DeepSpeed, which is not installed: {INSTALL}")
        require(precision == "fp32", f"strategy={self.name} runs train.precision=fp32 only here, got {precision}")
        require(grad_accum_steps == 1, f"strategy={self.name} takes train.grad_accum_steps=1 only (DeepSpeed's "
                f"ZeRO 2 and 3 have no no_sync), got {grad_accum_steps}")


@dataclass
class DeepSpeedZero1Spec(DeepSpeedSpec):
    """DeepSpeed ZeRO stage 1: optimizer state partitioned; gradients all-reduced after backward."""

    _target_: str = "ddp_lab.spec.strategies.deepspeed.DeepSpeedZero1Spec"
    name: str = "deepspeed_zero1"
    zero_stage = 1


@dataclass
class DeepSpeedZero2Spec(DeepSpeedSpec):
    """DeepSpeed ZeRO stage 2: gradients reduced to their owners in buckets during backward, optimizer state
    partitioned, updated partitions all-gathered."""

    _target_: str = "ddp_lab.spec.strategies.deepspeed.DeepSpeedZero2Spec"
    name: str = "deepspeed_zero2"
    zero_stage = 2


@dataclass
class DeepSpeedZero3Spec(DeepSpeedSpec):
    """DeepSpeed ZeRO stage 3: parameters partitioned too, gathered per module for forward and backward
    (parameters under stage3_param_persistence_threshold, 100k elements, stay whole)."""

    _target_: str = "ddp_lab.spec.strategies.deepspeed.DeepSpeedZero3Spec"
    name: str = "deepspeed_zero3"
    zero_stage = 3
