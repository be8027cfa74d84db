"""What every model's config node has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from omegaconf import MISSING


@dataclass
class ModelConfig:
    """What every model's config node has. `_target_` is the model class, `name` the group option (a label
    in results and W&B); the other keys are the class's arguments. Each model class has a node of its own
    (spec/models/, one file per class), which its YAMLs in conf/model/ extend; a model from outside the
    package is a YAML whose `_target_` names its class (examples/conf/model/). The model's facts
    (parameters, FLOPs, activations) are counted from the module itself (ddp_lab/models/facts.py)."""

    _target_: str = MISSING
    name: str = MISSING
    vocab_size: int = 10000
    """Token ids the model embeds; data=text sets 256 (its bytes); a token file's ids must be below it."""
    context_length: int = 128
    """Tokens per sequence."""

    takes_tokens: ClassVar[bool] = True
    """The model maps token ids to logits, so a job can train it (models/ffn.py's maps activations: the
    calculator's only); launch.py refuses one that does not before anything else."""
