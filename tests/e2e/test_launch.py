"""launch.py end to end: real torchrun, real gloo ranks, results.json and the offline W&B run."""

import glob

import pytest

from tests.helpers.launching import FAST, launch, results
from tests.helpers.wandb_records import read_run

pytestmark = pytest.mark.slow


def test_single_run_writes_results_and_wandb(tmp_path):
    proc = launch(*FAST, "strategy=naive", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = tmp_path / "run"
    res = results(job)
    assert res["status"] == "ok" and res["error"] is None
    assert res["env"]["world_size"] == 2 and res["env"]["backend"] == "gloo"
    assert res["config"]["strategy"]["name"] == "naive"
    assert [s["step"] for s in res["steps"]] == [0, 1, 2, 3]
    summary = res["summary"]
    assert summary["measured_steps"] == 3  # warm-up step excluded
    assert set(summary["step_time_ms"]) == {"mean", "std", "p50", "p90", "p95", "min", "max"}
    assert summary["comm_ms"]["p50"] > 0
    # naive: one all-reduce per gradient tensor; toy has embed + 2 layers x 2 Linear (w, b) + out = 10
    assert summary["collectives_per_step"] == 10
    # The offline W&B run holds every step's metrics, the run's group and the resolved config.
    (run_file,) = glob.glob(str(job / "wandb" / "offline-run-*" / "run-*.wandb"))
    run = read_run(run_file)
    logged = [row for row in run["history"] if "step_time_ms" in row]
    assert [row["step"] for row in logged] == [0, 1, 2, 3]
    assert all(row["comm_ms"] > 0 for row in logged)
    assert run["run"].run_group and run["run"].display_name.startswith("naive-toy-ws2")
    assert run["config"]["strategy"]["name"] == "naive"
    assert run["summary"]["step_time_ms/p50"] == pytest.approx(summary["step_time_ms"]["p50"])
    # The held-out loss after the last step (train.eval_every=0): in its step's record and the summary.
    assert [s["step"] for s in res["steps"] if "val_loss" in s] == [3]
    assert logged[-1]["val_loss"] == pytest.approx(res["steps"][-1]["val_loss"])
    assert run["summary"]["final_val_loss"] == pytest.approx(summary["final_val_loss"])


def test_two_job_sweep_one_group(tmp_path):
    proc = launch(*FAST, "strategy=naive,flat", "logger=wandb", tmp_path=tmp_path, multirun=True)
    assert proc.returncode == 0, proc.stderr
    sweep = tmp_path / "multirun"
    runs = [results(sweep / str(i)) for i in range(2)]
    assert [r["status"] for r in runs] == ["ok", "ok"]
    assert [r["config"]["strategy"]["name"] for r in runs] == ["naive", "flat"]
    groups = {read_run(glob.glob(str(sweep / str(i) / "wandb" / "offline-run-*" / "run-*.wandb"))[0])["run"].run_group
              for i in range(2)}
    assert len(groups) == 1  # one sweep, one W&B group: one comparison
    # The end-of-sweep table names both jobs.
    assert "naive" in proc.stdout and "flat" in proc.stdout and "p50" in proc.stdout


def test_logger_none_writes_no_wandb(tmp_path):
    proc = launch(*FAST, "logger=none", "world_size=4", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert results(tmp_path / "run")["env"]["world_size"] == 4
    assert not (tmp_path / "run" / "wandb").exists()
