"""A table is a list of columns over records: one shape for every table the lab prints or writes.

A record is one job flattened (analysis/records.py: `job_records`), or any row of dicts (the cost
model's predictions). A `Column` says its header, the record key it shows and how to format it; `table`
turns records into a header and string cells, and `markdown` writes those cells as Markdown. The
terminal's tables (analysis/tables.py), report.md's (analysis/report.py) and report.csv (the records
themselves) so show one number under one name, formatted one way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    header: str
    key: str
    fmt: str = "{:.1f}"
    """How a value is written (str.format); a missing value is '-'."""
    group: str = ""
    """'' for a column that names a row (job, strategy, ...); else the group of figures it belongs to
    (speed, memory, accuracy, collectives), which the terminal prints as a table of its own."""

    def cell(self, record: dict) -> str:
        value = record.get(self.key)
        if value is None:
            return "-"
        return value if isinstance(value, str) else self.fmt.format(value)


def table(records: list[dict], columns: list[Column], keep_empty: bool = False) -> tuple[list[str], list[list[str]]]:
    """Header and string cells; a figure column no record has a value for is left out (it would only take
    width), unless `keep_empty`."""
    rows = [[c.cell(r) for c in columns] for r in records]
    keep = [i for i, c in enumerate(columns) if keep_empty or not c.group or any(row[i] != "-" for row in rows)]
    return [columns[i].header for i in keep], [[row[i] for i in keep] for row in rows]


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table; a row's status other than ok in bold."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    status = header.index("status") if "status" in header else None
    for cells in rows:
        if status is not None and cells[status] not in ("ok", "-"):
            cells = [*cells[:status], f"**{cells[status]}**", *cells[status + 1:]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)
