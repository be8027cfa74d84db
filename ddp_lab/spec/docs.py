"""The strategies and their knobs as rows for people: one-liners, types, defaults and meanings, read from
the specs' own docstrings (the string under each field, as in ddp_lab/config.py), so the docs' tables
(`python -m ddp_lab.spec --markdown`) and the specs cannot drift apart."""

from __future__ import annotations

import ast
import enum
import inspect
import textwrap
import typing
from dataclasses import MISSING, fields

from ddp_lab.spec.strategies import SPECS
from ddp_lab.spec.strategy import NOT_KNOBS, StrategySpec


def field_docs(cls: type) -> dict[str, str]:
    """{field: the string literal right under it in the class body}, through the base classes."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError, IndexError, AttributeError):
            continue
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def summary(cls: type) -> str:
    """The docstring's first paragraph, on one line."""
    return " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())


def type_and_default(cls: type, name: str) -> str:
    """`float (25.0)`, `naive, flat (bucketed)`, `fp32, bf16, fp16 (unset)`: the type, or the options, and
    the default."""
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
    kind = (", ".join(str(option.value) for option in base) if isinstance(base, type) and issubclass(base, enum.Enum)
            else getattr(base, "__name__", str(base)))
    default = {f.name: f.default for f in fields(cls)}[name]
    shown = "unset" if default is None else "required" if default is MISSING else (
        default.value if isinstance(default, enum.Enum) else default)
    return f"{kind} ({shown})"


def knobs(cls: type[StrategySpec]) -> list[dict]:
    docs = field_docs(cls)
    return [{"knob": f.name, "type": type_and_default(cls, f.name), "doc": docs.get(f.name, "")}
            for f in fields(cls) if f.name not in NOT_KNOBS]


def mesh_support(cls: type[StrategySpec]) -> str:
    """`dp axis` where the strategy runs on a mesh's data-parallel axis (parallel.tp or pp > 1), else why not;
    `dp axis, no pipeline` (and why) where it runs beside tensor parallelism only."""
    if cls.mesh_refusal is not None:
        return f"no: {cls.mesh_refusal}"
    return "dp axis" if cls.pipeline_refusal is None else f"dp axis, no pipeline: {cls.pipeline_refusal}"


def context_support(cls: type[StrategySpec]) -> str:
    """`dp x cp` where the strategy runs under context parallelism (parallel.cp > 1: it then averages over the dp x
    cp ranks, which hold the same weights), else why not (the mesh's refusal)."""
    if not cls.synchronizes:
        return "no: it synchronizes nothing, and context-parallel ranks must sum their tokens' gradients"
    return "dp x cp" if cls.mesh_refusal is None else "no"


def expert_support(cls: type[StrategySpec]) -> str:
    """`dense over dp x cp, experts over edp` where the strategy runs under expert parallelism (parallel.ep > 1),
    else why not."""
    if cls.expert_refusal is not None:
        return f"no: {cls.expert_refusal}"
    return "dense over dp x cp, experts over their edp group"


def strategy_rows() -> list[dict]:
    """Per registered strategy: its option, spec (file and class), runtime class, one-liner, knobs and whether it
    runs on a mesh's data-parallel axis."""
    return [{"name": name, "spec": f"spec/strategies/{cls.__module__.rsplit('.', 1)[1]}.py {cls.__name__}",
             "runtime": cls.runtime, "summary": summary(cls), "knobs": knobs(cls), "mesh": mesh_support(cls),
             "context": context_support(cls), "experts": expert_support(cls)}
            for name, cls in SPECS.items()]


def knob_rows() -> list[dict]:
    """Per knob and meaning: the strategies that have it so (a knob whose meaning differs by strategy, as
    comm_dtype through torch's hooks, gets a row per meaning)."""
    rows: dict[tuple, dict] = {}
    for name, cls in SPECS.items():
        for knob in knobs(cls):
            key = (knob["knob"], knob["type"], knob["doc"])
            rows.setdefault(key, {**knob, "strategies": []})["strategies"].append(name)
    return sorted(rows.values(), key=lambda r: r["knob"])
