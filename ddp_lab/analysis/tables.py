"""The comparison table printed after a job, at the end of a sweep, and by the report.

One row per job, failed jobs included (a failed row says so instead of leaving a gap).
"""

from __future__ import annotations

import textwrap

from rich.console import Console
from rich.table import Table

from ddp_lab.analysis.accuracy import accuracy
from ddp_lab.spec.labels import collective_label, row_label
from ddp_lab.units import MiB

# The accuracy columns (analysis/accuracy.py), after TRAIN_COLUMNS: (header, key, format).
ACCURACY_COLUMNS = [
    ("final loss", "final_loss", "{:.3f}"),
    ("Δ loss vs exact", "loss_gap", "{:+.3f}"),
    ("wire MiB/step", "comm_bytes_per_step", None),
    ("s to target", "time_to_target_s", "{:.1f}"),
    ("grad err", "grad_error_mean", "{:.1e}"),
]


def _get(d: dict | None, *path, default=None):
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


TRAIN_COLUMNS = [  # (header, path into results.json); times in ms
    ("step p50", ("summary", "step_time_ms", "p50")),
    ("step p90", ("summary", "step_time_ms", "p90")),
    ("comm p50", ("summary", "comm_ms", "p50")),
    ("exposed p50", ("summary", "exposed_comm_ms", "p50")),
    ("overlap %", ("summary", "overlap_pct")),
    ("colls/step", ("summary", "collectives_per_step")),
    ("model state MiB/rank", ("summary", "memory", "model_state_max_rank")),
    ("× ZeRO paper", ("summary", "memory", "model_state_ratio")),
    ("strategy state MiB/rank", ("summary", "memory", "strategy_state_max_rank")),
]  # optimizer state and the total: report.md's memory table (a terminal has room for so many columns)
MIB_COLUMNS = {"model state MiB/rank", "strategy state MiB/rank"}
DIGITS = {"× ZeRO paper": 3}  # the bar (1.05) needs more than one decimal


def train_rows(runs: list[tuple[str, dict]], target_loss: float | None = None,
               reference: str | None = None) -> tuple[list[str], list[list[str]]]:
    """Header and string cells for training runs: (job name, results) pairs in sweep order; the
    accuracy columns against each row's exact reference (analysis/accuracy.py; `reference` names
    one) and `target_loss` if given, at the end."""
    figures = accuracy(runs, target_loss, reference)
    header = ["job", "strategy", "model", "ranks", "status"] + [h for h, _ in TRAIN_COLUMNS]
    header += [h for h, _, _ in ACCURACY_COLUMNS]
    rows = []
    for job, res in runs:
        cfg = res.get("config") or {}
        status = res.get("status", "missing")
        cells = [job, row_label(res), _fmt(_get(cfg, "model", "name")), _fmt(cfg.get("world_size")), status]
        for header_name, path in TRAIN_COLUMNS:
            value = _get(res, *path)
            if header_name in MIB_COLUMNS and value is not None:
                value = value / MiB
            cells.append(_fmt(value, DIGITS.get(header_name, 1)))
        for _, key, form in ACCURACY_COLUMNS:
            value = figures.get(job, {}).get(key)
            if key == "comm_bytes_per_step" and value is not None:
                value, form = value / MiB, "{:.2f}"
            cells.append("-" if value is None else form.format(value))
        rows.append(cells)
    # An accuracy column no job has a figure for (no exact run, no grad_error) only takes width.
    first = len(header) - len(ACCURACY_COLUMNS)
    empty = [i for i in range(first, len(header)) if all(row[i] == "-" for row in rows)]
    keep = [i for i in range(len(header)) if i not in empty]
    return [header[i] for i in keep], [[row[i] for i in keep] for row in rows]


COLLECTIVE_COLUMNS = [  # (header, path into results.json)
    ("lat p50 ms", ("summary", "latency_ms", "p50")),
    ("lat min ms", ("summary", "latency_ms", "min")),
    ("lat max ms", ("summary", "latency_ms", "max")),
    ("algbw GB/s", ("summary", "algbw_GBps")),
    ("busbw GB/s", ("summary", "busbw_GBps")),
    ("iters", ("summary", "iters")),
]


def task_of(results: dict) -> str:
    """'train' or 'allreduce'; a job that died before saving its config counts as training."""
    return _get(results, "config", "task", "name", default="train") or "train"


def collective_rows(runs: list[tuple[str, dict]]) -> tuple[list[str], list[list[str]]]:
    """Header and string cells for task=allreduce jobs, one row per (op, size, ranks, backend)."""
    header = ["job", "op", "MiB", "ranks", "backend", "status"] + [h for h, _ in COLLECTIVE_COLUMNS]
    rows = []
    for job, res in runs:
        cfg = res.get("config") or {}
        backend = _get(res, "summary", "backend") or _get(res, "env", "backend") or _get(cfg, "backend", "name")
        size = _get(cfg, "task", "size_mb")
        cells = [job, collective_label(cfg.get("task") or {}), "-" if size is None else f"{size:g}",
                 _fmt(cfg.get("world_size")), _fmt(backend), res.get("status", "missing")]
        cells += [_fmt(_get(res, *path), 3) for _, path in COLLECTIVE_COLUMNS]
        rows.append(cells)
    return header, rows


# The figures a terminal shows, in groups that each get a table of their own (report.md and report.csv
# keep every column): `python -m ddp_lab.report SWEEP --columns speed,final loss` chooses.
GROUPS = {
    "speed": ("step p50", "step p90", "comm p50", "exposed p50", "overlap %", "colls/step"),
    "memory": ("model state MiB/rank", "× ZeRO paper", "strategy state MiB/rank"),
    "accuracy": tuple(h for h, _, _ in ACCURACY_COLUMNS),
    "collectives": tuple(h for h, _ in COLLECTIVE_COLUMNS),
}
# What names a row rather than measures it. Shown when it differs between rows, else in the title.
IDENTITY = ("job", "strategy", "model", "ranks", "op", "MiB", "backend", "status")
TEXT_COLUMNS = ("job", "strategy", "model", "status", "op", "backend")
FOLD_WIDTH = 24  # a text column wider than this wraps onto more lines (a figure never does)


def column_names() -> list[str]:
    """What `--columns` takes: a group's name or a column's header."""
    return list(GROUPS) + [h for group in GROUPS.values() for h in group]


def check_columns(columns: list[str] | None) -> None:
    unknown = [c for c in columns or [] if c not in column_names()]
    if unknown:
        raise ValueError(f"unknown column {unknown[0]!r}; columns: {', '.join(column_names())}")


def _chosen(header: list[str], columns: list[str] | None) -> list[str]:
    """The figure columns to show, in the table's order: all, or those `columns` names (groups or headers)."""
    figures = [h for h in header if h not in IDENTITY]
    if not columns:
        return figures
    named = {h for c in columns for h in GROUPS.get(c, (c,))}
    return [h for h in figures if h in named]


def _width(header: str, cells: list[str]) -> int:
    """Columns a figure needs: its longest cell, or its header's longest word (headers wrap between words)."""
    need = max([len(c) for c in cells] + [len(w) for w in header.split()])
    return min(need, FOLD_WIDTH) if header in TEXT_COLUMNS else need


def _table_width(widths: list[int]) -> int:
    """Terminal columns a table of these column widths takes."""
    return sum(w + 3 for w in widths) + 1  # rich's padding and rules around each column


def _rich(title: str, header: list[str], rows: list[list[str]], columns: list[str], widths: dict,
          width: int) -> Table:
    """A rich table of `columns`, each exactly its width: a header on one line where the terminal has
    room for it, else wrapped between words; figures never wrapped."""
    widths = {name: widths[name] for name in columns}
    for name in columns:
        spare = width - _table_width(list(widths.values()))
        if 0 < len(name) - widths[name] <= spare:
            widths[name] = len(name)
    table = Table(title=title, title_justify="left")
    failed = "status" in header
    for name in columns:
        text = textwrap.fill(name, widths[name], break_long_words=False)
        table.add_column(text, justify="left" if name in TEXT_COLUMNS else "right", overflow="fold",
                         no_wrap=name not in TEXT_COLUMNS, min_width=widths[name], max_width=widths[name])
    for cells in rows:
        style = "red" if failed and cells[header.index("status")] not in ("ok", "-") else None
        table.add_row(*(cells[header.index(name)] for name in columns), style=style)
    return table


def _vertical(title: str, header: list[str], cells: list[str], figures: list[str]) -> Table:
    """One job: a figure per line, grouped, empty figures left out."""
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("figure", justify="left", no_wrap=True)
    table.add_column("value", justify="left", overflow="fold")
    for name in (h for h in header if h in IDENTITY):
        table.add_row(name, cells[header.index(name)], style="red" if name == "status" and cells[
            header.index(name)] != "ok" else None)
    for group in GROUPS.values():
        shown = [h for h in group if h in figures and cells[header.index(h)] != "-"]
        if shown:
            table.add_section()
            for name in shown:
                table.add_row(name, cells[header.index(name)])
    return table


def terminal_tables(title: str, header: list[str], rows: list[list[str]], width: int,
                    columns: list[str] | None = None) -> list[Table]:
    """Tables that fit `width` terminal columns with every figure whole.

    One row: a vertical summary. Several: the identity columns that differ between rows (the others
    go into the first title), then each group of figures (speed, memory, accuracy; collectives) in a
    table of its own beside the identity columns again, split further where a group alone is too wide.
    """
    figures = _chosen(header, columns)
    if len(rows) == 1:
        return [_vertical(title, header, rows[0], figures)]
    widths = {h: _width(h, [r[i] for r in rows]) for i, h in enumerate(header)}
    figures = [h for h in figures if any(r[header.index(h)] != "-" for r in rows)]  # no figure: no column
    identity = [h for h in header if h in IDENTITY]
    same = [h for h in identity if h != "job" and len({r[header.index(h)] for r in rows}) == 1]
    ident = [h for h in identity if h not in same]
    first = title + ("  (" + ", ".join(f"{h} {rows[0][header.index(h)]}" for h in same) + ")" if same else "")
    chunks: list[tuple[str, list[str]]] = []
    for name, group in GROUPS.items():
        chunk: list[str] = []
        for h in (h for h in group if h in figures):
            if chunk and _table_width([widths[c] for c in ident + chunk + [h]]) > width:
                chunks.append((name, chunk))
                chunk = []
            chunk.append(h)
        if chunk:
            chunks.append((name, chunk))
    return [_rich(f"{first if i == 0 else title}: {name}", header, rows, ident + chunk, widths, width)
            for i, (name, chunk) in enumerate(chunks or [("no figures", [])])]


def comparison_tables(runs: list[tuple[str, dict]], title: str, target_loss: float | None = None,
                      reference: str | None = None, width: int = 80, columns: list[str] | None = None) -> list[Table]:
    """The terminal's tables, one set per task present (training and collective jobs have different columns)."""
    tables = []
    train = [(job, res) for job, res in runs if task_of(res) != "allreduce"]
    collective = [(job, res) for job, res in runs if task_of(res) == "allreduce"]
    if train:
        tables += terminal_tables(title, *train_rows(train, target_loss, reference), width, columns)
    if collective:
        tables += terminal_tables(title if not train else f"{title} (collectives)", *collective_rows(collective),
                                  width, columns)
    return tables


def print_tables(runs: list[tuple[str, dict]], title: str, target_loss: float | None = None,
                 reference: str | None = None, columns: list[str] | None = None,
                 console: Console | None = None) -> None:
    """Print the comparison at the terminal's width (80 when output is not a terminal, or $COLUMNS)."""
    console = console or Console()
    for table in comparison_tables(runs, title, target_loss, reference, console.width, columns):
        console.print(table)
