"""Each model class's config node, as each strategy has its spec: one file per class, torch-free (launch.py
reads them to refuse a bad key before any rank starts), registered here as `schema/model/NAME`; the
classes themselves are in ddp_lab/models/. A model from outside the package needs no node: its YAML
names its class (examples/conf/model/)."""

from ddp_lab.spec.models.base import ModelConfig
from ddp_lab.spec.models.ffn import FFNStackConfig
from ddp_lab.spec.models.moe import MoETransformerConfig
from ddp_lab.spec.models.toy_mlp import ToyMLPConfig
from ddp_lab.spec.models.transformer import TransformerConfig

MODEL_SCHEMAS = {"transformer": TransformerConfig, "toy_mlp": ToyMLPConfig, "ffn": FFNStackConfig,
                 "moe_transformer": MoETransformerConfig}
"""Each model class's node, stored as `schema/model/NAME` (conf/model/*.yaml list it in their defaults)."""

__all__ = ["MODEL_SCHEMAS", "FFNStackConfig", "ModelConfig", "MoETransformerConfig", "ToyMLPConfig",
           "TransformerConfig"]
