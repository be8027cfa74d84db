"""`python -m ddp_lab.spec`: every strategy, its one-liner and its knobs, read from the specs themselves.

    python -m ddp_lab.spec                      # text: a strategy, its one-liner, its knobs (type, default, meaning)
    python -m ddp_lab.spec --markdown           # the tables docs/strategies.md, configuration.md, measurements.md show
    python -m ddp_lab.spec --compose            # what composes with what on the mesh: docs/compose.md's table

The specs (and spec/figures.py, for every per-step figure) are the one home of these facts: the docs' tables
are this command's output (tests/unit/test_spec_docs.py checks they still are), so a knob added to a spec
shows in both without a second copy.
"""

from __future__ import annotations

import argparse
import sys

from ddp_lab.piped import exit_code
from ddp_lab.spec.compose import compose_markdown
from ddp_lab.spec.docs import knob_rows, strategy_rows
from ddp_lab.spec.figures import figures_markdown

BEGIN = "<!-- python -m ddp_lab.spec --markdown {}: begin -->"
END = "<!-- python -m ddp_lab.spec --markdown {}: end -->"
TABLES = ("strategies", "knobs", "figures")


def markdown(table: str) -> str:
    """The `strategies`, `knobs` or `figures` table in Markdown, between the markers the docs keep it in."""
    if table == "figures":
        lines = [figures_markdown()]
    elif table == "strategies":
        lines = ["| strategy | spec | runtime class | on a mesh | with cp | with ep | what it does |",
                 "|---|---|---|---|---|---|---|"]
        lines += [f"| `{r['name']}` | `{r['spec']}` | `{r['runtime']}` | {r['mesh']} | {r['context']} | "
                  f"{'no' if r['experts'].startswith('no') else 'yes'} | {r['summary']} |" for r in strategy_rows()]
    else:
        lines = ["| knob | strategies | type (default) | meaning |", "|---|---|---|---|"]
        lines += [f"| `strategy.{r['knob']}` | {', '.join(r['strategies'])} | {r['type']} | {r['doc']} |"
                  for r in knob_rows()]
    return "\n".join([BEGIN.format(table), *lines, END.format(table)])


def text() -> str:
    out = []
    for row in strategy_rows():
        out.append(f"{row['name']}: {row['summary']}")
        out.append(f"    on a mesh (parallel.tp or pp > 1): {row['mesh']}")
        out.append(f"    with context parallelism (parallel.cp > 1): {row['context']}")
        out.append(f"    with expert parallelism (parallel.ep > 1): {row['experts']}")
        out += [f"    {k['knob']}: {k['type']}  {k['doc']}" for k in row["knobs"]] or ["    (no knobs)"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_lab.spec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="the strategies, knobs and figures tables, in Markdown")
    parser.add_argument("--compose", action="store_true",
                        help="each feature on each axis: proven, refused or open (docs/compose.md)")
    args = parser.parse_args(argv)
    if args.compose:
        print(compose_markdown())
        return 0
    print("\n\n".join(markdown(t) for t in TABLES) if args.markdown else text())
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(main))
