"""model=tiny, small, medium, large, xl, 2.7b: the node of ddp_lab.models.Transformer (conf/model/*.yaml extend it)."""

from __future__ import annotations

from dataclasses import dataclass

from ddp_lab.spec.models.base import ModelConfig


@dataclass
class TransformerConfig(ModelConfig):
    """ddp_lab.models.Transformer: CS336's pre-norm decoder (RMSNorm, RoPE, SwiGLU, untied head)."""

    _target_: str = "ddp_lab.models.Transformer"
    d_model: int = 768
    """Width of the residual stream."""
    d_ff: int = 3072
    """Hidden width of each SwiGLU feed-forward block."""
    num_layers: int = 12
    num_heads: int = 12
    """Attention heads; d_model must divide by it."""
    rope_theta: float = 10000.0
