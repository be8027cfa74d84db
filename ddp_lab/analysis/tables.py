"""The comparison tables printed after a job, at the end of a sweep, and by the report.

One row per job, failed jobs included (a failed row says so instead of leaving a gap). Every table is a
list of columns over the jobs' records (analysis/columns.py, analysis/records.py): the same columns
at the terminal and in report.md's "Training" and "Collectives".
"""

from __future__ import annotations

import textwrap

from rich.console import Console
from rich.table import Table

from ddp_lab.analysis.columns import Column
from ddp_lab.analysis.columns import table as column_table
from ddp_lab.analysis.records import job_records
from ddp_lab.spec.figures import ALGBW, BUSBW

ROW = [Column("job", "job"), Column("strategy", "label"), Column("model", "model"),
       Column("ranks", "world_size", "{}"), Column("status", "status")]
TRAIN_ROW = [*ROW[:4], Column("mesh", "mesh", "{}"), Column("pipeline", "pipeline", "{}"), ROW[4]]  # dp x tp (x pp)
TRAINING = TRAIN_ROW + [  # times in ms, the slowest rank per step; memory of the largest rank
    Column("step p50", "step_p50_ms", group="speed"), Column("step p90", "step_p90_ms", group="speed"),
    Column("× floor", "vs_floor", "{:.2f}", group="speed"), Column("× torch's", "vs_torch", "{:.2f}", group="speed"),
    Column("comm p50", "comm_p50_ms", group="speed"), Column("exposed p50", "exposed_p50_ms", group="speed"),
    Column("overlap %", "overlap_pct", group="speed"),
    Column("trace overlap %", "trace_overlap_pct", group="speed"),  # profile=true: from the traces
    Column("colls/step", "collectives_per_step", group="speed"),
    Column("tp comm p50", "tp_comm_p50_ms", group="speed"),  # the tensor-parallel axis: blocking, all exposed
    Column("tp colls/step", "tp_collectives_per_step", "{:.0f}", group="speed"),
    Column("tp MiB/step", "tp_comm_mib_per_step", "{:.2f}", group="speed"),
    Column("× torch TP", "vs_torch_tp", "{:.2f}", group="speed"),
    Column("compile s", "compile_s", "{:.1f}", group="speed"),  # train.compile: beyond a measured step
    Column("skew p50", "skew_p50_ms", group="speed"), Column("straggler", "straggler", group="speed"),
    Column("injected", "injected", group="speed"),
    Column("model state MiB/rank", "model_state_mib_per_rank", group="memory"),
    Column("× ZeRO paper", "model_state_vs_paper", "{:.3f}", group="memory"),  # the bar (1.05) needs 3 digits
    Column("strategy state MiB/rank", "strategy_state_mib_per_rank", group="memory"),
    Column("activations MiB/rank", "activations_mib_per_rank", "{:.1f}", group="memory"),  # the first step's peak
    Column("params held %", "tp_params_held_pct", "{:.1f}", group="memory"),  # under TP: this rank's pieces
    # the accuracy figures (analysis/accuracy.py)
    Column("final loss", "final_loss", "{:.4f}", group="accuracy"),  # validation where it is a curve
    Column("val loss", "final_val_loss", "{:.4f}", group="accuracy"),
    Column("Δ loss vs exact", "loss_gap", "{:+.4f}", group="accuracy"),
    Column("wire MiB/step", "comm_mib_per_step", "{:.2f}", group="accuracy"),
    Column("s to target", "time_to_target_s", "{:.2f}", group="accuracy"),
    Column("grad err", "grad_error_mean", "{:.2e}", group="accuracy"),
    # a pipeline's bubble (analysis/pipeline.py): measured, the schedule's, replayed at the stages' compute
    Column("bubble %", "bubble_pct", "{:.1f}", group="pipeline"),
    Column("× torch PP", "vs_torch_pp", "{:.2f}", group="pipeline"),
    Column("schedule's bubble %", "bubble_schedule_pct", "{:.1f}", group="pipeline"),
    Column("at stage times %", "bubble_stages_pct", "{:.1f}", group="pipeline"),
    Column("pp idle ms", "pp_idle_mean_ms", group="pipeline"),
    Column("pp wait ms", "pp_wait_mean_ms", group="pipeline"),
    Column("p2p MiB/step", "p2p_mib_per_step", "{:.2f}", group="pipeline"),
    # context parallelism (ddp_lab/context_parallel/): the exchange, how much of it hid, the causal imbalance
    Column("cp MiB/step", "cp_mib_per_step", "{:.2f}", group="context"),
    Column("cp wait p50", "cp_exposed_p50_ms", group="context"),  # the most-waiting rank: imbalance included
    Column("cp exposed ms", "cp_exposed_busiest_ms", group="context"),  # the busiest rank's: the exchange's own
    Column("cp alone ms", "cp_alone_ms", group="context"),  # the ring's exchange with nothing to hide under
    Column("cp hidden %", "cp_hidden_pct", "{:.0f}", group="context"),
    Column("attention p50", "cp_attention_p50_ms", group="context"),  # the busiest rank's blocks
    Column("work max/mean", "cp_imbalance_counted", "{:.2f}", group="context"),  # pairs scored
    Column("time max/mean", "cp_imbalance_measured", "{:.2f}", group="context"),  # attention time
    # a mixture of experts (models/moe.py) and expert parallelism (ddp_lab/expert_parallel/)
    Column("ep MiB/step", "ep_mib_per_step", "{:.2f}", group="experts"),  # to the other ep ranks, 4 directions
    Column("a2a p50", "ep_exchange_p50_ms", group="experts"),  # inside the all-to-alls: blocking, all exposed
    Column("busiest expert", "moe_busiest_share_p50", "{:.3f}", group="experts"),  # its share of the slots
    Column("load max/mean", "moe_max_over_mean_p50", "{:.2f}", group="experts"),
    Column("dropped %", "moe_dropped_pct_mean", "{:.1f}", group="experts"),
    Column("expert MiB/rank", "expert_mib_per_rank", "{:.1f}", group="experts"),  # parameters; falls as 1/ep
]  # optimizer state and the total: report.md's memory table (a terminal has room for so many columns)
COLLECTIVES = [
    Column("job", "job"), Column("op", "op_label"), Column("MiB", "size_mb", "{:g}"),
    Column("ranks", "world_size", "{}"), Column("backend", "backend"), Column("status", "status"),
    Column("lat p50 ms", "latency_p50_ms", "{:.3f}", "collectives"),
    Column("lat min ms", "latency_min_ms", "{:.3f}", "collectives"),
    Column("lat max ms", "latency_max_ms", "{:.3f}", "collectives"),
    Column("algbw GB/s", ALGBW.key, "{:.3f}", "collectives"),
    Column("busbw GB/s", BUSBW.key, "{:.3f}", "collectives"), Column("iters", "iters", "{}", "collectives"),
]


def train_rows(runs: list[tuple[str, dict]], target_loss: float | None = None,
               reference: str | None = None) -> tuple[list[str], list[list[str]]]:
    """Header and string cells for training runs: (job name, results) pairs in sweep order; the
    accuracy columns against each row's exact reference (analysis/accuracy.py; `reference` names
    one) and `target_loss` if given. A figure no job has (no exact run, no grad_error) is left out."""
    return column_table(job_records(runs, target_loss, reference), TRAINING)


def collective_rows(runs: list[tuple[str, dict]]) -> tuple[list[str], list[list[str]]]:
    """Header and string cells for task=allreduce jobs, one row per (op, size, ranks, backend)."""
    return column_table(job_records(runs), COLLECTIVES, keep_empty=True)


# The figures a terminal shows, in groups that each get a table of their own (report.md and report.csv
# keep every column): `python -m ddp_lab.report SWEEP --columns speed,final loss` chooses.
GROUPS: dict[str, tuple[str, ...]] = {}
for _column in TRAINING + COLLECTIVES:
    if _column.group:
        GROUPS[_column.group] = (*GROUPS.get(_column.group, ()), _column.header)
# What names a row rather than measures it. Shown when it differs between rows, else in the title.
IDENTITY = tuple(dict.fromkeys(c.header for c in TRAINING + COLLECTIVES if not c.group))
TEXT_COLUMNS = ("job", "strategy", "model", "pipeline", "status", "op", "backend", "straggler", "injected")
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
    for name in (h for h in header if h in IDENTITY and cells[header.index(h)] != "-"):
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
    named = [h for h in same if rows[0][header.index(h)] != "-"]  # a key no row has (no pipeline) goes unsaid
    first = title + ("  (" + ", ".join(f"{h} {rows[0][header.index(h)]}" for h in named) + ")" if named else "")
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


def comparison_tables(records: list[dict], title: str, width: int = 80,
                      columns: list[str] | None = None) -> list[Table]:
    """The terminal's tables of job records, one set per task present (training and collective jobs have
    different columns)."""
    tables = []
    train = [r for r in records if r["task"] != "allreduce"]
    collective = [r for r in records if r["task"] == "allreduce"]
    if train:
        tables += terminal_tables(title, *column_table(train, TRAINING), width, columns)
    if collective:
        tables += terminal_tables(title if not train else f"{title} (collectives)",
                                  *column_table(collective, COLLECTIVES, keep_empty=True), width, columns)
    return tables


def print_records(records: list[dict], title: str, columns: list[str] | None = None,
                  console: Console | None = None) -> None:
    """Print the comparison at the terminal's width (80 when output is not a terminal, or $COLUMNS)."""
    console = console or Console()
    for rich_table in comparison_tables(records, title, console.width, columns):
        console.print(rich_table)


def print_tables(runs: list[tuple[str, dict]], title: str, target_loss: float | None = None,
                 reference: str | None = None, columns: list[str] | None = None,
                 console: Console | None = None) -> None:
    """`print_records` of (job name, results) pairs, with their accuracy figures (analysis/accuracy.py)."""
    print_records(job_records(runs, target_loss, reference), title, columns, console)
