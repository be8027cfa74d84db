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


def test_strategies_md_has_a_heading_per_strategy():
    """So that each can be linked to (docs/strategies.md#zero2)."""
    lines = (DOCS / "strategies.md").read_text().splitlines()
    headings = {line[4:].strip() for line in lines if line.startswith("### ")}
    assert set(SPECS) <= headings, sorted(set(SPECS) - headings)


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


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    kept = "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _anchors(page: str) -> set[str]:
    return {_slug(line.lstrip("#")) for line in (DOCS / page).read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", ["benchmarks.md", "predict.md", "strategies.md", "notebook/predict.md"])
def test_links_to_sections_land_on_a_heading(page):
    """The findings on benchmarks.md's first screen link to their sections: each link must find one."""
    import posixpath
    import re

    for target, anchor in re.findall(r"\]\(([a-z_./]*\.md)?#([^)]+)\)", (DOCS / page).read_text()):
        where = posixpath.normpath(posixpath.join(posixpath.dirname(page), target)) if target else page
        assert anchor in _anchors(where), f"docs/{page}: no heading for {where}#{anchor}"


def test_predict_md_is_a_reference_of_a_few_screens():
    """The predictor's reference stays short (what to trust, commands, the model in brief); its dated runs
    and derivations belong in docs/notebook/predict.md."""
    assert len((DOCS / "predict.md").read_bytes()) <= 10 * 1024


def test_the_first_screens_say_what_was_found():
    """benchmarks.md opens with its findings, predict.md with what to trust the predictor for."""
    assert "## What was found" in "\n".join((DOCS / "benchmarks.md").read_text().splitlines()[:5])
    assert "## What to trust it for" in "\n".join((DOCS / "predict.md").read_text().splitlines()[:8])
