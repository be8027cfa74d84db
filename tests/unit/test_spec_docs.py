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


def test_the_strategy_pages_have_a_heading_per_strategy():
    """So that each can be linked to (docs/strategies/sharded.md#zero2), and strategies.md links each."""
    lines = [line for page in (DOCS / "strategies").glob("*.md") for line in page.read_text().splitlines()]
    headings = {line[4:].strip() for line in lines if line.startswith("### ")}
    assert set(SPECS) <= headings, sorted(set(SPECS) - headings)
    index = (DOCS / "strategies.md").read_text()
    assert all(f".md#{name})" in index for name in SPECS), "docs/strategies.md lost a strategy's link"


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
    """The README's table of strategies and axes names each strategy in backticks and says how many there are:
    a strategy registered without it (or one removed) fails here, so the count cannot drift again. (Every link
    of the docs landing on a heading: tests/unit/test_docs_links.py.)"""
    import re

    readme = (DOCS.parent / "README.md").read_text()
    table = readme.split("\n## Strategies and axes", 1)[1].split("\n## ", 1)[0]
    named = {word for word in re.findall(r"`([a-z0-9_]+)`", table)}
    assert named == set(SPECS), f"README names {sorted(named ^ set(SPECS))} unlike the registry"
    assert f"{NUMBERS[len(SPECS)]} strategies are options" in table


def test_predict_md_is_a_reference_of_a_few_screens():
    """The predictor's reference stays short (what to trust, commands, the model in brief); its dated runs
    and derivations belong in docs/notebook/predict.md."""
    assert len((DOCS / "predict.md").read_bytes()) <= 10 * 1024


def test_the_first_screens_say_what_was_found():
    """benchmarks.md opens with its findings, predict.md with what to trust the predictor for."""
    assert "## What was found" in "\n".join((DOCS / "benchmarks.md").read_text().splitlines()[:5])
    assert "## What to trust it for" in "\n".join((DOCS / "predict.md").read_text().splitlines()[:8])
