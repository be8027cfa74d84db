"""`Strategy`: what `conf/strategy/*.yaml` instantiates and the trainer talks to.

The trainer never names a strategy. It asks this object to wrap the model and to build the
optimizer; the YAML decides which wrapper class (and which optimizer, for sharded ones) that is.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class Strategy:
    def __init__(self, name: str, wrapper: Callable[[nn.Module], nn.Module],
                 optimizer: Callable | None = None, **knobs):
        self.name = name
        self._wrapper = wrapper
        self._optimizer = optimizer
        # `knobs` (bucket_mb, grad_sync, comm) are accepted because the strategy's config node
        # carries them; they reach the wrapper through the YAML's interpolations, not from here.

    def wrap(self, model: nn.Module) -> nn.Module:
        return self._wrapper(model)

    def build_optimizer(self, params, optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
        if self._optimizer is None:
            return optimizer_cls(params, **kwargs)
        return self._optimizer(params, optimizer_cls, **kwargs)


KNOBS = ("bucket_mb", "grad_sync", "comm")


# Knobs a communication mode ignores: ZeRO-1's reduce-scatter replaces the gradient-sync wrapper.
IGNORED_BY_COMM = {"reduce_scatter": ("bucket_mb", "grad_sync")}


def knob_label(strategy_cfg) -> str:
    """`bucketed-bucket_mb=25`: a strategy config's name and the knobs it uses, for run names."""
    ignored = IGNORED_BY_COMM.get(strategy_cfg.get("comm"), ())
    knobs = [f"{k}={strategy_cfg[k]}" for k in KNOBS if strategy_cfg.get(k) is not None and k not in ignored]
    return "-".join([strategy_cfg["name"]] + knobs)
