"""The accuracy cost in the report and the end-of-sweep table, on hand-made results (no run, no torch)."""

import csv
import math

import pytest

from ddp_lab.analysis.accuracy import accuracy, is_exact
from ddp_lab.analysis.report import main, make_report
from ddp_lab.analysis.tables import train_rows
from tests.helpers.report_fixtures import write_job


def job(strategy="bucketed", loss=(4.0, 3.0, 2.0, 1.0), step_ms=100.0, nbytes=1000, precision="fp32",
        comm_dtype=None, model="tiny", grad_error=None, status="ok", world_size=2, lr=1e-3, **knobs):
    cfg = {"task": {"name": "train"}, "model": {"name": model, "d_model": 32}, "world_size": world_size,
           "train": {"precision": precision, "lr": lr, "warmup_steps": 3}, "backend": {"name": "gloo"},
           "strategy": {"name": strategy, "comm_dtype": comm_dtype, **knobs}}
    steps = [{"step": i, "loss": v, "step_time_ms": step_ms, **({"grad_error": grad_error} if grad_error else {})}
             for i, v in enumerate(loss)]
    summary = {"comm_bytes_per_step": nbytes, "step_time_ms": {"p50": step_ms}}
    return {"status": status, "error": None, "config": cfg, "env": {}, "summary": summary, "steps": steps}


RUNS = [
    ("0", job()),                                                                       # the exact reference
    ("1", job(comm_dtype="bf16", loss=(4.0, 3.2, 1.04, 1.1), step_ms=80.0, nbytes=500, grad_error=3e-3)),
    ("2", job(precision="bf16", loss=(4.0, 3.5, 3.0, 2.5))),                             # never reaches the target
    ("3", job(strategy="powersgd", rank=4, loss=(4.0, 3.0, 2.0, 1.2), nbytes=100)),
    ("4", job(model="toy", comm_dtype="fp16", nbytes=500)),                              # no exact run of toy
    ("5", job(comm_dtype="fp32")),                                                       # exact too, but second
]


def test_which_runs_are_exact():
    assert [is_exact(res) for _, res in RUNS] == [True, False, False, False, False, True]


def test_gap_bytes_and_time_to_the_default_target():
    figures = accuracy(RUNS)
    ref, bf16, mixed, powersgd, toy, second = (figures[name] for name, _ in RUNS)
    assert ref["reference_job"] == "0" and second["reference_job"] == "0" and toy["reference_job"] is None
    assert ref["reference_why"] == "exact run of the same strategy and knobs"   # "5" is alike: the first
    assert powersgd["reference_why"] == "the one exact configuration like it"   # bucketed ("0" and "5")
    assert ref["loss_gap"] == 0.0 and ref["bytes_vs_reference"] == 1.0
    assert math.isclose(bf16["final_loss"], 1.1) and math.isclose(bf16["loss_gap"], 0.1)
    assert math.isclose(bf16["loss_gap_pct"], 10.0) and bf16["bytes_vs_reference"] == 0.5
    assert math.isclose(bf16["target_loss"], 1.05)                      # exact final loss 1.0 + 5%
    assert math.isclose(bf16["time_to_target_s"], 0.24) and bf16["steps_to_target"] == 2  # 3 steps of 80 ms
    assert math.isclose(ref["time_to_target_s"], 0.4) and ref["steps_to_target"] == 3
    assert mixed["time_to_target_s"] is None and mixed["steps_to_target"] is None
    assert math.isclose(powersgd["loss_gap"], 0.2) and powersgd["bytes_vs_reference"] == 0.1
    assert toy["loss_gap"] is None and toy["target_loss"] is None and toy["time_to_target_s"] is None
    assert bf16["grad_error_mean"] == 3e-3 and ref["grad_error_mean"] is None


def test_the_reference_differs_only_in_what_is_compared():
    runs = [("naive", job("naive", loss=(4.0, 1.0))), ("bucketed", job(loss=(4.0, 1.0))),
            ("lr", job(lr=1e-2, loss=(4.0, 0.5))), ("ws4", job(world_size=4, nbytes=1500)),
            ("powersgd", job("powersgd", rank=4, loss=(4.0, 1.2), nbytes=100)),
            ("bf16", job(precision="bf16", loss=(4.0, 1.1)))]
    figures = accuracy(runs)
    # powersgd: two exact configurations fit (naive and bucketed; the lr and 4-rank runs differ in more)
    assert figures["powersgd"]["reference_job"] is None and figures["powersgd"]["loss_gap"] is None
    assert figures["powersgd"]["reference_why"] == ("2 exact configurations fit (naive, bucketed): "
                                                    "name one with --reference JOB")
    assert figures["bf16"]["reference_job"] == "bucketed"                    # its own strategy in fp32
    assert figures["lr"]["reference_job"] == "lr" and figures["ws4"]["reference_job"] == "ws4"  # themselves
    named = accuracy(runs, reference="naive")
    assert named["powersgd"]["reference_job"] == "naive" and named["powersgd"]["reference_why"] == "--reference"
    assert named["powersgd"]["bytes_vs_reference"] == 0.1 and math.isclose(named["powersgd"]["loss_gap"], 0.2)
    assert named["ws4"]["reference_job"] is None
    assert named["ws4"]["reference_why"] == "differs from --reference naive in world_size"
    assert named["lr"]["reference_why"] == "differs from --reference naive in train.lr"
    with pytest.raises(ValueError, match="--reference nope: not a finished training job"):
        accuracy(runs, reference="nope")


def test_a_given_target_loss_replaces_the_default():
    figures = accuracy(RUNS, target_loss=2.5)
    assert math.isclose(figures["0"]["time_to_target_s"], 0.3) and figures["0"]["steps_to_target"] == 2
    assert math.isclose(figures["2"]["time_to_target_s"], 0.4)          # it reaches 2.5 at its last step
    assert math.isclose(figures["4"]["time_to_target_s"], 0.3)          # a target for models without a reference


def test_failed_job_without_steps_is_a_row_not_a_crash():
    figures = accuracy([("0", job()), ("1", job(status="failed", loss=()))])
    assert figures["1"]["final_loss"] is None and figures["1"]["loss_gap"] is None


def test_sweep_table_has_the_accuracy_columns():
    header, rows = train_rows(RUNS)
    at = {h: i for i, h in enumerate(header)}
    # one format per figure, the terminal's and report.md's alike (analysis/tables.py, report.py)
    assert rows[1][at["final loss"]] == "1.1000" and rows[1][at["Δ loss vs exact"]] == "+0.1000"
    assert rows[1][at["s to target"]] == "0.24" and rows[2][at["s to target"]] == "-"
    assert rows[1][at["grad err"]] == "3.00e-03" and rows[0][at["grad err"]] == "-"
    assert "precision=bf16" in rows[2][header.index("strategy")]        # compute dtype tells rows apart


@pytest.fixture
def sweep(tmp_path):
    for name, res in RUNS:
        write_job(tmp_path / name, res)
    return tmp_path


def test_report_writes_the_accuracy_section_csv_and_loss_picture(sweep):
    report = make_report(sweep, quiet=True)
    md = report["md"].read_text()
    assert "## Accuracy cost" in md and "exact run's final loss + 5%" in md
    assert (sweep / "report_loss.png").exists() and "report_loss.png" in md
    with open(report["csv"]) as f:
        rows = {r["job"]: r for r in csv.DictReader(f)}
    assert math.isclose(float(rows["1"]["loss_gap"]), 0.1) and rows["1"]["reference_job"] == "0"


def test_report_cli_takes_a_target_loss_and_a_reference(sweep, tmp_path, capsys):
    assert main([str(sweep), "--target-loss", "2.5"]) == 0
    md = (sweep / "report.md").read_text()
    assert "the target loss is 2.5 (--target-loss)" in md
    assert ("| 3 | powersgd-bucket_mb=25.0-rank=4-start_iter=10 | 2 | ok | training | 1.2000 | - | 0 | the one "
            "exact configuration like it |") in md  # the label: the knobs of the strategy's spec, defaults included
    assert main([str(sweep), "--reference", "5"]) == 0
    row = "| 0 | bucketed-bucket_mb=25.0 | 2 | ok | training | 1.0000 | - | 5 | --reference |"
    assert row in (sweep / "report.md").read_text()
    capsys.readouterr()
    assert main([str(sweep), "--reference", "9", "-o", str(tmp_path / "not_written")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--reference 9: not a finished training job" in err[0]
    assert not (tmp_path / "not_written").exists()


def test_columns_no_job_has_a_figure_for_are_left_out():
    header, rows = train_rows([("0", job()), ("1", job(model="toy"))])
    assert "final loss" in header and "grad err" not in header
    assert all(len(row) == len(header) for row in rows)


def _with_val(res, val_losses, data="text"):
    """The job with a validation loss on the steps `val_losses` names ({step: loss}) and its data source."""
    out = {**res, "steps": [{**s, **({"val_loss": val_losses[s["step"]]} if s["step"] in val_losses else {})}
                            for s in res["steps"]],
           "config": {**res["config"], "data": {"name": data}}}
    out["summary"] = {**res["summary"], "final_val_loss": val_losses.get(len(res["steps"]) - 1)}
    return out


def test_a_validation_curve_replaces_the_training_loss_everywhere():
    """Two or more held-out points: final loss, gap and time to target are the validation loss's; one point
    (eval after the last step only) leaves the training loss and shows the validation loss beside it."""
    runs = [("exact", _with_val(job(), {1: 3.5, 3: 2.0})),
            ("bf16", _with_val(job(comm_dtype="bf16", loss=(4.0, 3.0, 2.0, 0.5)), {1: 2.05, 3: 2.2})),
            ("once", _with_val(job(comm_dtype="fp16"), {3: 2.3}))]
    figures = accuracy(runs)
    exact, bf16, once = figures["exact"], figures["bf16"], figures["once"]
    assert exact["loss_kind"] == bf16["loss_kind"] == "validation" and once["loss_kind"] == "training"
    assert bf16["final_loss"] == 2.2 and math.isclose(bf16["loss_gap"], 0.2)   # not the training loss 0.5
    assert math.isclose(bf16["target_loss"], 2.1) and bf16["steps_to_target"] == 1   # 2.05 at step 1
    assert math.isclose(bf16["time_to_target_s"], 0.2)
    assert once["final_loss"] == 1.0 and once["final_val_loss"] == 2.3


def test_jobs_on_other_data_are_never_each_others_reference():
    runs = [("synthetic", _with_val(job(), {}, data="synthetic")), ("text", _with_val(job(comm_dtype="bf16"), {}))]
    assert accuracy(runs)["text"]["reference_job"] is None
