"""docs/plan.md's example outputs are what the planner prints today: each fenced block opening with
`$ python -m ddp_lab.plan ...` is run and its output compared line for line (the planner is arithmetic, the same on
any machine). When a change to the planner moves a figure, the page's transcripts are regenerated with it:
`python -m tests.unit.test_plan_transcripts` rewrites them."""

from __future__ import annotations

import contextlib
import io
import shlex
from pathlib import Path

import pytest

from ddp_lab.analysis.plan.cli import main

PAGE = Path(__file__).resolve().parents[2] / "docs" / "plan.md"
PROMPT = "$ python -m ddp_lab.plan "


def transcripts(text: str) -> list[tuple[str, list[str]]]:
    """(command, its printed lines) of every fenced block that opens with the planner's prompt."""
    blocks, lines, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            if fenced and lines and lines[0].startswith(PROMPT):
                blocks.append((lines[0][2:], lines[1:]))
            fenced, lines = not fenced, []
        elif fenced:
            lines.append(line)
    return blocks


CASES = transcripts(PAGE.read_text())


def printed_by(command: str) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(shlex.split(command)[3:]) == 0
    return out.getvalue().splitlines()


def test_the_page_has_its_transcripts():
    assert len(CASES) >= 3


@pytest.mark.parametrize("command, printed", CASES, ids=[c for c, _ in CASES])
def test_each_transcript_is_what_the_planner_prints(command, printed):
    assert printed_by(command) == printed, f"regenerate docs/plan.md's output of: {command} (module docstring)"


if __name__ == "__main__":
    text = PAGE.read_text()
    for command, printed in CASES:
        text = text.replace("\n".join([f"$ {command}", *printed]), "\n".join([f"$ {command}", *printed_by(command)]))
    PAGE.write_text(text)
