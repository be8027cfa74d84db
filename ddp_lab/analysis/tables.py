"""The comparison table printed after a job, at the end of a sweep, and by the report.

One row per job, failed jobs included (a failed row says so instead of leaving a gap).
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ddp_lab.analysis.accuracy import accuracy
from ddp_lab.analysis.labels import collective_label, row_label
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


def comparison_tables(runs: list[tuple[str, dict]], title: str, target_loss: float | None = None,
                      reference: str | None = None) -> list[Table]:
    """One table per task present (training and collective jobs have different columns)."""
    tables = []
    train = [(job, res) for job, res in runs if task_of(res) != "allreduce"]
    collective = [(job, res) for job, res in runs if task_of(res) == "allreduce"]
    if train:
        tables.append(rich_table(title, *train_rows(train, target_loss, reference)))
    if collective:
        tables.append(rich_table(title if not train else f"{title} (collectives)", *collective_rows(collective)))
    return tables


TEXT_COLUMNS = ("job", "strategy", "model", "status", "op", "backend")


def rich_table(title: str, header: list[str], rows: list[list[str]]) -> Table:
    table = Table(title=title)
    for name in header:
        table.add_column(name, justify="left" if name in TEXT_COLUMNS else "right")
    for cells in rows:
        style = None if cells[header.index("status")] == "ok" else "red"
        table.add_row(*cells, style=style)
    return table


def print_table(table: Table) -> None:
    """Print at the terminal's width, or wide enough for every column when output is a file."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    console.print(table)
