"""The docs' tables of strategies, knobs and per-step figures are what the specs and spec/figures.py say
(`python -m ddp_lab.spec --markdown`), and the command lists every strategy with its one-liner and knobs."""

from dataclasses import fields
from pathlib import Path

import pytest

from ddp_lab.spec.__main__ import BEGIN, END, main, markdown
from ddp_lab.spec.docs import field_docs
from ddp_lab.spec.strategies import SPECS
from ddp_lab.spec.strategies.zero1 import Zero1Spec

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize("table, page", [("strategies", "strategies.md"), ("knobs", "configuration.md"),
                                         ("figures", "measurements.md")])
def test_the_docs_tables_are_the_specs(table, page):
    text = (DOCS / page).read_text()
    begin, end = BEGIN.format(table), END.format(table)
    assert begin in text and end in text, f"docs/{page} lost its generated {table} table"
    shown = text[text.index(begin):text.index(end) + len(end)]
    assert shown == markdown(table), f"docs/{page} is stale: paste `python -m ddp_lab.spec --markdown` over it"


def test_every_knob_has_its_meaning_written_under_it():
    for cls in SPECS.values():
        docs = field_docs(cls)
        assert all(docs.get(f.name) for f in fields(cls)), cls.__name__
    assert field_docs(Zero1Spec)["comm"].startswith("The communication pattern")


def test_the_command_lists_every_strategy(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert all(f"{name}: " in out for name in SPECS) and "    grad_sync: naive, flat" in out


NUMBERS = {13: "Thirteen", 14: "Fourteen", 15: "Fifteen", 16: "Sixteen", 17: "Seventeen", 18: "Eighteen",
           19: "Nineteen", 20: "Twenty"}


def test_the_readme_names_every_registered_strategy_and_counts_them():
    """The README's opening paragraph names each strategy in backticks and says how many there are:
    a strategy registered without it (or one removed) fails here, so the count cannot drift again."""
    import re

    readme = (DOCS.parent / "README.md").read_text()
    opening = readme.split("\n## ", 1)[0]
    named = {word for word in re.findall(r"`([a-z0-9_]+)`", opening)}
    assert named == set(SPECS), f"README names {sorted(named ^ set(SPECS))} unlike the registry"
    assert f"{NUMBERS[len(SPECS)]} strategies are options" in opening
