"""model=tiny_moe, small_moe: the node of ddp_lab.models.MoETransformer (conf/model/*_moe.yaml extend it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ddp_lab.spec.models.transformer import TransformerConfig


@dataclass
class MoETransformerConfig(TransformerConfig):
    """ddp_lab.models.MoETransformer: the lab's Transformer with a mixture of SwiGLU experts in place of every
    block's feed-forward (ddp_lab/models/moe.py); `parallel.ep` splits the experts over ranks."""

    _target_: str = "ddp_lab.models.MoETransformer"
    d_ff: Optional[int] = None
    """Unused (each expert's width is expert_d_ff); kept so the dense model's tools read the node."""
    experts: int = 8
    """Routed experts in every layer."""
    top_k: int = 2
    """Experts each token goes to; the combine weights are the chosen scores, renormalized when top_k > 1."""
    expert_d_ff: int = 512
    """Hidden width of each expert (and of the shared expert)."""
    shared_experts: int = 0
    """0 or 1: an expert every token goes to besides its routed ones (DeepSeek-V3 keeps one)."""
    router: str = "softmax"
    """softmax over the experts, or sigmoid (DeepSeek-V3) with the selection-only bias balance=bias moves."""
    balance: str = "aux_loss"
    """aux_loss: the Switch loss over the global batch; bias: the aux-loss-free bias moved from counts summed over
    every rank (DeepSeek-V3, torchtitan, Megatron); none."""
    balance_coeff: float = 0.01
    """The aux loss's coefficient."""
    capacity_factor: Optional[float] = None
    """null: dropless. A number: each expert takes at most ceil(factor x tokens x top_k / experts) of a rank's
    routed slots, the rest dropped."""
    bias_rate: float = 1e-3
    """balance=bias: how far each optimizer step moves an expert's bias against its load."""
