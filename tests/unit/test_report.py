"""The report and the end-of-sweep table on fabricated job folders (fast, known answers); on a real sweep with
crashed jobs and profile=true: tests/e2e/test_report_launch.py."""

import io
import math
import re

import pytest
from omegaconf import OmegaConf
from rich.console import Console

from ddp_lab.analysis.end_of_run import SweepSummary
from ddp_lab.analysis.records import load_runs, task_of, train_record
from ddp_lab.analysis.report import main, make_report
from ddp_lab.analysis.tables import IDENTITY, collective_rows, print_tables, train_rows
from tests.helpers.report_fixtures import (
    LADDER,
    LADDER_PARAMS,
    MiB,
    assert_png,
    bucket_sweep,
    collective_results,
    collective_sweep,
    ladder_sweep,
    memory_summary,
    read_csv,
    train_results,
    write_job,
)


def test_bucket_sweep_with_benchmark_predicts_best_bucket(tmp_path):
    buckets = bucket_sweep(tmp_path / "buckets")
    bench = collective_sweep(tmp_path / "bench", overhead_s=2e-3, bandwidth_Bps=2e9)
    for mb in (1, 10, 100):  # calls timed back to back are another measurement: the bucket fit leaves them out
        write_job(bench / f"b2b{mb}", collective_results(mb, 9e-3, 0.5e9, barrier=False))
    report = make_report(buckets, collectives=bench, quiet=True)
    (pred,) = report["predictions"]
    assert pred["overhead_s"] == pytest.approx(2e-3, rel=1e-6) and pred["bandwidth_Bps"] == pytest.approx(2e9, rel=1e-6)
    # bucket* = sqrt(s o w) with s = 64 MiB of gradients: 15.6 MiB; measured best is the 25 MiB job.
    assert pred["best_bucket_mb"] == pytest.approx(math.sqrt(64 * MiB * 2e-3 * 2e9) / MiB)
    assert pred["measured_best_step_mb"] == 25
    rows = read_csv(buckets / "report.csv")
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "failed"]
    assert rows[3]["error"].startswith("rank 1: InjectedFault")
    md = (buckets / "report.md").read_text()
    assert "**failed**" in md and "Jobs that did not end ok" in md and "predicted best bucket" in md
    assert {p.name for p in report["png"]} == {"report_phases.png", "report_buckets.png"}
    for png in report["png"]:
        assert_png(png)
        assert f"]({png.name})" in md


def test_phases_take_a_sharded_optimizers_wait_out_of_the_update():
    """zero1 waits 300 ms for its parameter broadcasts inside step(): that is exposed comm taken from
    the optimizer phase (leaving the update), not from compute; the phases still add up to the step."""
    means = {"fwd_bwd_ms": 900.0, "sync_ms": 100.0, "optimizer_ms": 500.0, "step_time_ms": 1510.0,
             "exposed_comm_ms": 400.0, "exposed_optimizer_comm_ms": 300.0}
    record = train_record({"config": {}, "summary": {k: {"mean": v} for k, v in means.items()}})
    assert record["compute_mean_ms"] == 900.0  # fwd_bwd + sync - the 100 ms waited in sync
    assert record["exposed_mean_ms"] == 400.0
    assert record["optimizer_mean_ms"] == 200.0
    assert record["other_mean_ms"] == pytest.approx(10.0)
    del means["exposed_optimizer_comm_ms"]  # results written before the split: all exposed in sync
    record = train_record({"config": {}, "summary": {k: {"mean": v} for k, v in means.items()}})
    assert (record["compute_mean_ms"], record["optimizer_mean_ms"]) == (600.0, 500.0)


def test_ladder_sweep_memory_table_and_picture(tmp_path):
    """Three rungs at 2 and 4 ranks, each holding a known multiple of the ZeRO paper's figure: the
    report recomputes the paper's figure (fp32 AdamW, 16 bytes per parameter in full) and the
    ratio, tables both, and draws the memory-vs-step-time picture (the crashed job only noted)."""
    sweep = ladder_sweep(tmp_path / "ladder")
    report = make_report(sweep, quiet=True)
    assert {p.name for p in report["png"]} == {"report_phases.png", "report_ladder.png"}
    for png in report["png"]:
        assert_png(png)
    full_mib = 16 * LADDER_PARAMS / MiB  # 16 MiB
    fraction = {  # the ZeRO paper's share of the full state per stage, fp32 AdamW (4 + 4 + 8)
        (0, 2): 1, (1, 2): (4 + 4 + 4) / 16, (2, 2): (4 + 2 + 4) / 16,
        (0, 4): 1, (1, 4): (4 + 4 + 2) / 16, (2, 4): (4 + 1 + 2) / 16}
    records = [r for r in report["records"] if r["status"] == "ok"]
    assert len(records) == 6
    for r in records:
        stage, ratio = LADDER[r["strategy"]]
        assert r["zero_stage"] == stage
        assert r["paper_model_state_mib"] == pytest.approx(full_mib * fraction[stage, r["world_size"]])
        assert r["model_state_vs_paper"] == pytest.approx(ratio, abs=1e-5)
        assert r["model_state_mib_per_rank"] == pytest.approx(ratio * r["paper_model_state_mib"], rel=1e-5)
    md = (sweep / "report.md").read_text()
    assert "## Model state per rank: measured vs ZeRO paper" in md
    table = md.split("## Model state per rank: measured vs ZeRO paper")[1].split("##")[0]
    zero2_ws4 = next(line for line in table.splitlines() if line.startswith("| 5 |"))
    assert "| 2 | fp32 |" in zero2_ws4 and "| 7.0 |" in zero2_ws4 and "| 1.020 |" in zero2_ws4  # (4 + 12/4) MiB
    assert "× ZeRO paper" in md  # the training table's column


def test_no_ladder_picture_for_one_strategy(tmp_path):
    """One strategy at two world sizes is no ladder: the table, but no picture."""
    for i, ws in enumerate((2, 4)):
        write_job(tmp_path / str(i), train_results("zero2", world_size=ws, memory=memory_summary(LADDER_PARAMS, ws, 2)))
    report = make_report(tmp_path, quiet=True)
    assert "report_ladder.png" not in {p.name for p in report["png"]}
    assert "## Model state per rank" in (tmp_path / "report.md").read_text()


def test_collective_sweep_bandwidth_plot_and_csv(tmp_path):
    bench = collective_sweep(tmp_path / "bench", overhead_s=1e-3, bandwidth_Bps=1e9)
    report = make_report(bench, quiet=True)
    assert [p.name for p in report["png"]] == ["report_bandwidth.png"]
    assert_png(report["png"][0])
    rows = read_csv(bench / "report.csv")
    assert rows[-1]["status"] == "failed"
    ok = rows[0]  # 1 MiB at 2 ranks: t = 1 ms + 1 MiB / 1 GB/s
    t = 1e-3 + MiB / 1e9
    assert float(ok["algbw_GBps"]) == pytest.approx(MiB / t / 1e9)
    assert float(ok["busbw_GBps"]) == pytest.approx(MiB / t / 1e9)  # 2(n-1)/n = 1 at n=2
    assert "## Collectives" in (bench / "report.md").read_text()


def test_single_job_folder_and_empty_folder(tmp_path, capsys):
    job = bucket_sweep(tmp_path / "sweep", failed=False) / "1"
    assert main([str(job)]) == 0
    assert (job / "report.md").exists() and (job / "report.csv").exists()
    assert len(read_csv(job / "report.csv")) == 1
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no job folders" in capsys.readouterr().err


def test_sweep_table_handles_collective_sweeps_and_failed_rows(tmp_path, capsys):
    bench = collective_sweep(tmp_path / "bench")
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(bench)}}})
    with pytest.raises(SystemExit) as exit_info:
        SweepSummary().on_multirun_end(config=config)
    assert exit_info.value.code == 1
    out = capsys.readouterr()
    assert "busbw" in out.out and "failed" in out.out and "all_reduce" in out.out
    assert "1 of 7 jobs did not end ok: 6" in out.err


def _printed(runs, width: int, columns=None) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    print_tables(runs, "sweep", columns=columns, console=console)
    return console.export_text()


@pytest.mark.parametrize("width", [80, 100])
@pytest.mark.parametrize("make", [bucket_sweep, ladder_sweep, collective_sweep])
def test_terminal_tables_show_every_figure_whole(make, width, tmp_path):
    """At 80 and 100 columns no line is wider than the terminal, nothing is cut to an ellipsis, and
    every figure of every job (one job: the vertical summary; a sweep: the grouped tables) is printed
    whole."""
    runs = [(n, r) for n, r, _ in load_runs(make(tmp_path / "sweep"))]
    for shown in (runs, runs[:1]):
        text = _printed(shown, width)
        assert max(len(line) for line in text.splitlines()) <= width
        assert "…" not in text
        rows_of = collective_rows if task_of(shown[0][1]) == "allreduce" else train_rows
        header, rows = rows_of(shown)
        words = set(re.findall(r"[^\s│┃]+", text))
        figures = {cell for row in rows for h, cell in zip(header, row) if h not in IDENTITY and cell != "-"}
        assert figures and figures <= words


def test_terminal_tables_take_columns_by_group_or_header(tmp_path, capsys):
    runs = [(n, r) for n, r, _ in load_runs(ladder_sweep(tmp_path / "sweep"))]
    memory_only = _printed(runs, 80, ["memory"])
    assert "paper" in memory_only and "p50" not in memory_only
    assert "p90" in _printed(runs, 80, ["step p90"]) and "p50" not in _printed(runs, 80, ["step p90"])
    assert main([str(tmp_path / "sweep"), "--columns", "speed,nonsense"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown column 'nonsense'; columns: speed, memory")


def test_step_time_against_link_rate_is_drawn_for_a_sweep_of_rates(tmp_path):
    """network=emulated jobs at 0.1 and 1 Gbit/s and unshaped: report_link_rate.png, one line per strategy;
    jobs on the host network, or one rate only, draw nothing."""
    from ddp_lab.analysis import plots
    from ddp_lab.analysis.records import record
    from tests.helpers.report_fixtures import train_results

    def job(strategy, gbps, step_ms):
        res = train_results(strategy, step_ms=step_ms)
        res["config"]["network"] = {"name": "emulated", "nodes": 2, "gbps": gbps}
        return record(f"{strategy}-{gbps}", res)

    sweep = [job(s, g, ms / (g or 10)) for s, ms in (("bucketed", 500.0), ("powersgd", 50.0)) for g in (0.1, 1, None)]
    assert [r["link_gbps"] for r in sweep[:3]] == [0.1, 1, None] and sweep[0]["network"] == "emulated"
    assert plots.plot_link_rate(sweep, tmp_path / "rate.png")
    assert_png(tmp_path / "rate.png")
    assert not plots.plot_link_rate([r for r in sweep if r["link_gbps"] == 1], tmp_path / "one.png")
    host = [record("h", train_results("bucketed"))]
    assert host[0]["network"] == "host" and not plots.plot_link_rate(host, tmp_path / "host.png")
