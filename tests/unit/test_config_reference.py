"""docs/configuration.md documents every key a user can type: each field of the run's schema (ddp_lab/config.py),
of every data and network source's and of every model class's node, named in backticks (`key`, or the dotted
`group.key`) in the page. A key added to a schema without a line there fails here. (The strategies' knobs are
the page's generated table: tests/unit/test_spec_docs.py.)"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from ddp_lab.config import DATA_SCHEMAS, NETWORK_SCHEMAS, Config
from ddp_lab.spec.models import MODEL_SCHEMAS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def keys(cls, prefix: str = "") -> list[str]:
    """Every dotted key of a schema dataclass, its nested dataclasses' too; fields typed Any (the groups) are
    their options' schemas to list."""
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        kinds = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
        if len(kinds) == 1 and dataclasses.is_dataclass(kinds[0]):
            out.extend(keys(kinds[0], f"{prefix}{f.name}."))
        elif hints[f.name] is not typing.Any:
            out.append(prefix + f.name)
    return out


INTERNAL = ("name", "_target_")  # set by the group's option (task=allreduce sets task.name), not typed
ALL_KEYS = {*keys(Config), *(k for s in DATA_SCHEMAS.values() for k in keys(s, "data.")),
            *(k for s in NETWORK_SCHEMAS.values() for k in keys(s, "network.")),
            *(k for s in MODEL_SCHEMAS.values() for k in keys(s, "model."))}
SCHEMA_KEYS = sorted(k for k in ALL_KEYS if k.rsplit(".", 1)[-1] not in INTERNAL)


@pytest.mark.parametrize("key", SCHEMA_KEYS)
def test_every_key_is_documented(key):
    text = PAGE.read_text()
    last = key.rsplit(".", 1)[-1]
    assert f"`{key}`" in text or f"`{last}`" in text or f"`{key}=" in text, \
        f"{key}: not in docs/configuration.md (add it to its group's row, with its type, default and limits)"
