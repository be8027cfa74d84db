"""model=toy: the node of ddp_lab.models.ToyMLP (conf/model/toy.yaml extends it)."""

from __future__ import annotations

from dataclasses import dataclass

from ddp_lab.spec.models.base import ModelConfig


@dataclass
class ToyMLPConfig(ModelConfig):
    """ddp_lab.models.ToyMLP: token embeddings through an MLP, no attention."""

    _target_: str = "ddp_lab.models.ToyMLP"
    d_model: int = 64
    """Width of the embeddings."""
    d_ff: int = 256
    """Hidden width of each layer."""
    num_layers: int = 2
