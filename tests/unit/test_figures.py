"""The measurement record's one home (spec/figures.py): every per-step figure is described once, every
reader takes the table, and results.json carries its schema version.

- each figure's key is spelled as a string literal in at most two modules of ddp_lab/ (its row, and the
  code that emits it), besides the homonyms listed below: other records that reuse the name for another
  number (the predictor's own fields, phases.json's interval lists, the implementation that ran);
- the job's summary gives statistics of exactly the figures the table says, W&B is told each one's summary;
- results.json says its schema; a newer one is refused in one line (the report exits 2 with it), an old
  one without the field is read.
"""

import ast
import json
from pathlib import Path

import pytest

from ddp_lab.analysis.report import main as report_main
from ddp_lab.arithmetic.stats import summarize_training
from ddp_lab.jobdir import RESULTS, ResultsSchemaError, make_results, read_results
from ddp_lab.rank.recorder import declare_metrics
from ddp_lab.spec.figures import FIGURES, SCHEMA_VERSION, figure, figures_markdown, training_figures

PACKAGE = Path(__file__).resolve().parents[2] / "ddp_lab"

HOMONYMS = {
    # the predictor's own records (phases.json's comm intervals, its predicted step figures and fits):
    # the one schedule interpreter will take them from this table
    "analysis/predict/": {"comm_ms", "optimizer_ms", "collectives", "busbw_GBps", "loss"},
    "rank/profiler.py": {"comm_ms"},  # phases.json: the step's comm intervals, not their union
    "arithmetic/traces.py": {"comm_ms"},  # a profiler trace's comm lane per rank
    "analysis/timeline.py": {"comm_ms"},  # the same, drawn
    "rank/worker.py": {"collectives"},  # env.collectives: the implementation that ran (ring, native)
    "spec/labels.py": {"collectives"},  # the same, in run names
    "analysis/records.py": {"collectives"},  # the collective benchmark's summary.collectives: the same
    "analysis/tables.py": {"collectives"},  # the terminal's group of collective columns
    "analysis/calculator.py": {"comm_bytes"},  # the calculator's bytes from the schedule, not measured
    "analysis/report.py": {"loss"},  # a column header
}


def _homonym(module: str, key: str) -> bool:
    return any(module.startswith(prefix) and key in keys for prefix, keys in HOMONYMS.items())


def test_each_figure_is_spelled_in_its_row_and_where_it_is_emitted_only():
    keys = {f.key for f in FIGURES}
    places: dict[str, set[str]] = {k: set() for k in keys}
    for path in PACKAGE.rglob("*.py"):
        module = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in keys and not _homonym(module, node.value):
                places[node.value].add(module)
    for key, modules in places.items():
        assert "spec/figures.py" in modules, key
        assert len(modules) <= 2, f"{key!r} is spelled in {sorted(modules)}: read it from spec/figures.py"


def test_the_summary_gives_statistics_of_the_figures_the_table_names():
    steps = [{"step": i, **{f.key: float(i + 1) for f in training_figures()}} for i in range(4)]
    summary = summarize_training(steps, warmup_steps=1)
    summarized = {f.key for f in training_figures() if f.summarized}
    assert {k for k, v in summary.items() if isinstance(v, dict) and "p50" in v} == summarized
    assert summary[figure("step_time_ms").key]["p50"] == 3.0  # steps 1-3 after one warm-up step


def test_wandb_is_told_each_figures_summary():
    calls = []

    class Run:
        def define_metric(self, name, **kwargs):
            calls.append((name, kwargs.get("summary")))

    declare_metrics(Run())
    told = dict(calls)
    assert {f.key: f.wandb for f in FIGURES if f.wandb}.items() <= told.items()
    assert told["step_time_ms"] == "mean" and told["val_loss"] == "min" and told["loss"] == "last"


def test_the_docs_table_lists_every_figure():
    table = figures_markdown()
    assert all(f"| `{f.key}` |" in table for f in FIGURES)


def _write(tmp_path: Path, results: dict) -> Path:
    job = tmp_path / "job"
    job.mkdir(exist_ok=True)
    (job / RESULTS).write_text(json.dumps(results))
    return job


def test_results_say_their_schema_and_a_newer_one_is_refused(tmp_path, capsys):
    written = make_results("ok", None, {}, {}, {}, [])
    assert written["schema"] == SCHEMA_VERSION
    old = {k: v for k, v in written.items() if k != "schema"}  # version 1: the same layout, no field
    assert read_results(_write(tmp_path, old)) == old
    job = _write(tmp_path, {**written, "schema": SCHEMA_VERSION + 1})
    with pytest.raises(ResultsSchemaError, match="schema"):
        read_results(job)
    assert report_main([str(job)]) == 2  # a refusal, as for any bad input
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "schema" in err and "\n" not in err
