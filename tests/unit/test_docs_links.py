"""Every relative link of the README and the docs resolves: the file exists, and its anchor is a heading of that
file (GitHub's slugs: lower case, punctuation dropped, spaces to hyphens, a repeated heading numbered) or an
explicit `<a id=...>`. A moved file or a renamed heading fails here, naming the page and the link."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "tests" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"`|\*\*|__|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        if re.match(r"#{1,6} ", line):
            base = slug(line.lstrip("#"))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", line))
    return frozenset(found)


def _links(page: Path):
    fenced = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if not re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                yield number, target


CASES = [pytest.param(page, target, id=f"{page.relative_to(ROOT)}:{number}:{target}")
         for page in PAGES for number, target in _links(page)]


def test_the_docs_have_links_to_prove():
    assert len(CASES) >= 50


@pytest.mark.parametrize("page, target", CASES)
def test_every_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    where = (page.parent / path).resolve() if path else page
    assert where.exists(), f"{page.relative_to(ROOT)}: {target}: no such file"
    if anchor and where.suffix == ".md":
        assert anchor in anchors(where), f"{page.relative_to(ROOT)}: {target}: no heading #{anchor} in {where.name}"


@pytest.mark.parametrize("heading, expected", [
    ("## Measured: the overview's table, DP, PP, TP and their pairs",
     "measured-the-overviews-table-dp-pp-tp-and-their-pairs"),
    ("### `zero2`", "zero2"), ("## Ring collectives on gloo (2026-11-28)", "ring-collectives-on-gloo-2026-11-28")])
def test_slugs_are_githubs(heading, expected):
    assert slug(heading.lstrip("#")) == expected
