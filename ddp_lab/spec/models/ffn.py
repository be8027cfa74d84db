"""model=xxl_ffn: the node of ddp_lab.models.FFNStack (conf/model/xxl_ffn.yaml extends it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ddp_lab.spec.models.base import ModelConfig


@dataclass
class FFNStackConfig(ModelConfig):
    """ddp_lab.models.FFNStack: blocks of two bias-free linears on activations, the course's accounting model; the
    calculator counts it, no job trains it (it takes no tokens)."""

    _target_: str = "ddp_lab.models.FFNStack"
    vocab_size: int = 0
    """None: it takes activations, not token ids."""
    d_model: int = 16384
    """Width of the activations between blocks."""
    d_ff: int = 53248
    """Width inside each block."""
    num_layers: int = 126

    takes_tokens: ClassVar[bool] = False
