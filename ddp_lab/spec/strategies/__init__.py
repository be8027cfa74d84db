"""Every strategy's spec, one file each, and the table of them (`SPECS`).

| option (`strategy=`) | spec | runtime class (ddp_lab/strategies) |
|---|---|---|
| none | none.py `NoneSpec` | `NoSync` (no_sync.py): the floor |
| naive | naive.py `NaiveSpec` | `NaiveDDP` (naive.py) |
| flat | flat.py `FlatSpec` | `FlatDDP` (flat.py) |
| overlap | overlap.py `OverlapSpec` | `OverlapDDP` (overlap.py) |
| bucketed | bucketed.py `BucketedSpec` | `BucketedDDP` (bucketed.py) |
| torch_ddp | torch_ddp.py `TorchDDPSpec` | `TorchDDP` (torch_ddp.py) |
| zero1 | zero1.py `Zero1Spec` | `Zero1` + `ShardedOptimizer` (zero1/) |
| zero1_torch | zero1_torch.py `TorchZero1Spec` | `TorchZero1` (zero1/torch_reference.py) |
| zero2 | zero2.py `Zero2Spec` | `Zero2` (zero2.py) |
| fsdp | fsdp.py `FSDPSpec` | `FSDP` (fsdp/) |
| fsdp_torch | fsdp_torch.py `TorchFSDPSpec` | `TorchFSDP` (fsdp_torch.py) |
| hsdp | hsdp.py `HSDPSpec` | `HSDP` (hsdp.py, on fsdp/) |
| powersgd | powersgd.py `PowerSGDSpec` | `PowerSGD` (powersgd.py) |
| local_sgd | local_sgd.py `LocalSGDSpec` | `LocalSGD` (local_sgd.py) |
| replicate_torch | replicate_torch.py `TorchReplicateSpec` | `TorchReplicate` (replicate_torch.py) |
| deepspeed_zero1, _zero2, _zero3 | deepspeed.py `DeepSpeedZero1Spec`, ... | `DeepSpeedZeRO` (deepspeed_zero.py) |

`register(config_store)` stores each spec as the schema `spec/strategy/NAME` that
`conf/strategy/NAME.yaml` extends. `spec_of(node)` turns any strategy config node (a composed config,
the config a rank reads, results.json's `config.strategy`) back into its typed spec. A strategy from
outside the package (examples/) is a spec of the user's own, named by `_target_` in the user's YAML.
"""

from __future__ import annotations

import importlib
from dataclasses import fields
from typing import Any, Mapping

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ddp_lab.spec.strategies.bucketed import BucketedSpec
from ddp_lab.spec.strategies.deepspeed import DeepSpeedZero1Spec, DeepSpeedZero2Spec, DeepSpeedZero3Spec
from ddp_lab.spec.strategies.demo import DeMoSpec
from ddp_lab.spec.strategies.flat import FlatSpec
from ddp_lab.spec.strategies.fsdp import FSDPSpec
from ddp_lab.spec.strategies.fsdp_torch import TorchFSDPSpec
from ddp_lab.spec.strategies.hsdp import HSDPSpec
from ddp_lab.spec.strategies.local_sgd import LocalSGDSpec
from ddp_lab.spec.strategies.local_sgd_torchft import TorchftLocalSGDSpec
from ddp_lab.spec.strategies.naive import NaiveSpec
from ddp_lab.spec.strategies.none import NoneSpec
from ddp_lab.spec.strategies.overlap import OverlapSpec
from ddp_lab.spec.strategies.powersgd import PowerSGDSpec
from ddp_lab.spec.strategies.replicate_torch import TorchReplicateSpec
from ddp_lab.spec.strategies.torch_ddp import TorchDDPSpec
from ddp_lab.spec.strategies.zero1 import Zero1Spec
from ddp_lab.spec.strategies.zero1_torch import TorchZero1Spec
from ddp_lab.spec.strategies.zero2 import Zero2Spec
from ddp_lab.spec.strategy import NOT_KNOBS, StrategySpec


def _default(cls: type, field_name: str):
    return {f.name: f.default for f in fields(cls)}.get(field_name)


def option(spec_cls: type[StrategySpec]) -> str:
    """The spec's option in the `strategy` group (its `name` field's default)."""
    return _default(spec_cls, "name")


SPECS: dict[str, type[StrategySpec]] = {option(cls): cls for cls in (
    NoneSpec, NaiveSpec, FlatSpec, OverlapSpec, BucketedSpec, TorchDDPSpec, Zero1Spec, TorchZero1Spec, Zero2Spec,
    PowerSGDSpec, LocalSGDSpec, TorchftLocalSGDSpec, DeMoSpec,
    FSDPSpec, TorchFSDPSpec, HSDPSpec, TorchReplicateSpec, DeepSpeedZero1Spec,
    DeepSpeedZero2Spec, DeepSpeedZero3Spec)}

SCHEMA_GROUP = "spec/strategy"


class SpecError(ValueError):
    """A strategy config that does not make a spec: one line, for the launcher or the report to print."""


def register(config_store) -> None:
    """Each spec as the schema `spec/strategy/NAME` (conf/strategy/NAME.yaml lists it in its defaults)."""
    for name, cls in SPECS.items():
        config_store.store(group=SCHEMA_GROUP, name=name, node=cls)


def spec_class(node: Mapping[str, Any]) -> type[StrategySpec]:
    """The spec class a strategy node names by `_target_`, without importing anything for ours. A
    results.json written before specs existed names the runtime class there (or nothing): its spec is
    found by name."""
    target = str(node.get("_target_") or "")
    for cls in SPECS.values():
        if target == _default(cls, "_target_"):
            return cls
    if (not target or target.startswith("ddp_lab.strategies.")) and str(node.get("name")) in SPECS:
        return SPECS[str(node.get("name"))]
    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise SpecError(f"strategy._target_={target or '(unset)'} cannot be imported: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, StrategySpec)):
        raise SpecError(f"strategy._target_={target} is not a strategy spec (a subclass of "
                        "ddp_lab.spec.strategy.StrategySpec): see docs/strategies.md, 'Adding a strategy'")
    return cls


def spec_of(node: Mapping[str, Any]) -> StrategySpec:
    """The typed spec of a strategy config node: knobs converted to their types and checked (`SpecError`,
    one line, for a wrong type, a knob the strategy does not have, or a value out of range)."""
    cls = spec_class(node)
    names = {f.name for f in fields(cls)}
    plain = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    legacy = plain.get("_target_") != _default(cls, "_target_")
    # a pre-spec results.json lists every strategy's knobs, unset ones as None, and its runtime class
    knobs = {k: v for k, v in plain.items() if k != "_target_" and not (legacy and v is None and k not in names)}
    unknown = sorted(set(knobs) - names)
    if unknown:
        raise SpecError(not_a_knob(cls, unknown[0]))
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), knobs))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        message = str(exc).splitlines()[0]
        raise SpecError(f"strategy.{key}: {message}" if key else message) from None
    except ValueError as exc:  # check(): a value out of range
        raise SpecError(str(exc)) from None


def own_format(name: str | None) -> str | None:
    """The strategy `name`'s own checkpoint format (its spec's `own_checkpoint`), None for DCP's pieces (or
    no such strategy)."""
    spec = SPECS.get(name)
    return spec.own_checkpoint if spec is not None else None


def not_a_knob(cls: type[StrategySpec], key: str) -> str:
    """One line for `strategy.KEY` set on a strategy whose spec has no such knob (or one it refuses)."""
    name = option(cls)
    if key == "comm_dtype" and not cls.reduces_gradients:
        return (f"strategy.comm_dtype does not apply to strategy={name}: it sends no gradients (it averages "
                "parameters, in their own dtype)")
    takes = [f.name for f in fields(cls) if f.name not in NOT_KNOBS]
    return f"strategy.{key} is not a knob of strategy={name} (its knobs: {', '.join(takes) or 'none'})"


__all__ = ["SPECS", "SpecError", "StrategySpec", "not_a_knob", "option", "register", "spec_class", "spec_of"]
