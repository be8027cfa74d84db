"""Models the strategies are compared on. Built from `conf/model/*.yaml` by `build_model`."""

from omegaconf import DictConfig

from ddp_lab.config import build
from ddp_lab.models.ffn import FFNStack
from ddp_lab.models.moe import MoETransformer
from ddp_lab.models.toy import ToyMLP
from ddp_lab.models.transformer import Transformer

__all__ = ["FFNStack", "MoETransformer", "ToyMLP", "Transformer", "build_model"]


def build_model(model_cfg: DictConfig):
    """Instantiate the model's `_target_` with every key but `name` (a label, not an argument)."""
    return build(model_cfg)
