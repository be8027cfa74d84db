"""Models the strategies are compared on. Built from `conf/model/*.yaml` by `build_model`."""

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from ddp_lab.models.toy import ToyMLP
from ddp_lab.models.transformer import Transformer

__all__ = ["ToyMLP", "Transformer", "build_model"]


def build_model(model_cfg: DictConfig):
    """Instantiate the model's `_target_` with every key but `name` (a label, not an argument)."""
    args = OmegaConf.masked_copy(model_cfg, [k for k in model_cfg if k != "name"])
    return instantiate(args)
