"""launch.py end to end: real torchrun, real gloo ranks, results.json and the offline W&B run."""

import glob
import json
import os
import subprocess
import sys
import warnings

import pytest

from ddp_lab.analysis import wandb_view
from tests.helpers.launching import FAST, launch, results
from tests.helpers.wandb_records import read_run, run_file_of_job

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


def test_two_job_sweep_one_wandb_folder_and_its_view(sweeps_started_together, tmp_path, monkeypatch):
    """The session's 2-job sweep (tests/e2e/conftest.py; another sweep ran beside it: test_scale), in the
    default output folder, which the view and the end-of-sweep output name as given: relative."""
    proc = sweeps_started_together["naive,flat"]
    assert proc.returncode == 0, proc.stderr
    sweep = proc.sweep
    runs = [results(sweep / str(i)) for i in range(2)]
    assert [r["status"] for r in runs] == ["ok", "ok"]
    assert [r["config"]["strategy"]["name"] for r in runs] == ["naive", "flat"]
    # every run of the sweep in one folder, SWEEP/wandb: what `wandb leet SWEEP/wandb` lists
    assert not (sweep / "0" / "wandb").exists()
    found = wandb_view.offline_runs(sweep)
    assert len(found) == 2
    logged = [read_run(run_file_of_job(sweep / str(i))) for i in range(2)]
    assert len({r["run"].run_group for r in logged}) == 1  # one sweep, one W&B group: one comparison
    assert [r["config"]["strategy"]["name"] for r in logged] == ["naive", "flat"]
    # leet's own non-interactive inspection reads each run back
    for folder, res in zip(sorted(found, key=lambda p: read_run(next(p.glob("*.wandb")))["config"]["strategy"]
                                  ["name"] != "naive"), runs):
        inspected = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json",
                                    str(folder)], capture_output=True, text=True, timeout=120)
        assert inspected.returncode == 0, inspected.stderr
        assert res["config"]["strategy"]["name"] in inspected.stdout and "step_time_ms" in inspected.stdout
    # the view spec, snapshot-checked: grouped by what the sweep varied, the panels the lab measures
    spec = json.loads((sweep / wandb_view.SPEC).read_text())
    assert spec == {"format": wandb_view.FORMAT, "name": f"ddp-lab {runs[0]['config']['logger']['group']}",
                    "project": "ddp-lab", "group": runs[0]["config"]["logger"]["group"],
                    "runs_folder": str(proc.relative / "wandb"), "jobs": 2, "groupby": ["strategy.value.name"],
                    "varied": ["strategy.name"], "sections": wandb_view.SECTIONS}
    panels = {p["title"] for s in spec["sections"] for p in s["panels"]}
    assert {"step time p50 (ms)", "overlap (%)", "validation loss against wall time", "bytes per step",
            "model state per rank (bytes, most-loaded rank)"} <= panels
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        view = wandb_view.workspace(spec, "someone", "ddp-lab")  # a valid wandb-workspaces view, built offline
    assert not [w for w in caught if "FilterExpr" in str(w.message)]  # our call is not the deprecated form
    assert str(view.runset_settings.filters) == f"Metric(\"Group\") == '{spec['group']}'"
    assert [s.name for s in view.sections] == ["Step time", "Communication", "Memory", "Loss"]
    # the end-of-sweep output says where the runs are and how to compare them
    assert f"wandb leet {proc.relative / 'wandb'}" in proc.stdout and "naive" in proc.stdout and "p50" in proc.stdout
    # --publish without a login: one line, exit 2, nothing written
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    pub = subprocess.run([sys.executable, "-m", "ddp_lab.report", str(sweep), "--publish", "someone/ddp-lab"],
                         capture_output=True, text=True, timeout=120, env={**os.environ})
    assert pub.returncode == 2 and pub.stderr.startswith("error: not logged in") and pub.stderr.count("\n") == 1
    assert not (sweep / "report.md").exists()
