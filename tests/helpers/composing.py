"""Hydra's composition of many command lines in one test, each choice of config groups composed once: Hydra takes a
third of a second a line here, and a test of every ranked layout or every refused cell composes a hundred."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml
from hydra import compose
from omegaconf import OmegaConf

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = frozenset(p.name for p in CONF.iterdir() if p.is_dir())


class ComposedOnce:
    """`self(overrides)`: the config of a command line (inside Hydra's `initialize_config_dir`). Its group choices
    (`model=tiny`, `strategy=zero2`) are composed by Hydra once; its plain keys are set on a copy with
    OmegaConf.update, which the schema still refuses for a key it lacks or a value of the wrong type."""

    def __init__(self):
        self.composed: dict[tuple, object] = {}

    def __call__(self, overrides: list[str]):
        choices = tuple(o for o in overrides if o.split("=")[0] in GROUPS)
        if choices not in self.composed:
            self.composed[choices] = compose("config", overrides=list(choices))
        cfg = copy.deepcopy(self.composed[choices])
        for key, value in (o.split("=", 1) for o in overrides if o not in choices):
            OmegaConf.update(cfg, key, yaml.safe_load(value))
        return cfg
