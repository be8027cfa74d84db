"""The predictor on real runs through launch.py: a small collective sweep and one profiled run make a
model file, and `validate` on those runs plus the session's examples sweep (the example strategy from outside
the package, replayed from the schedule its spec declares, bucketed and fsdp; tests/e2e/conftest.py) prints a
row per training job and its error line."""

import json
import math
import shutil

import pytest

from ddp_lab.analysis.predict.cli import main as predict
from ddp_lab.analysis.predict.schedule import job_step
from tests.helpers.launching import EXAMPLES, FAST, launch


@pytest.mark.slow
def test_fit_then_validate_on_real_runs(tmp_path, examples_sweep, capsys):
    coll, prof, train = tmp_path / "coll", tmp_path / "prof", tmp_path / "examples"
    for folder in (coll, prof):
        folder.mkdir()
    proc = launch("task=allreduce", "backend=gloo", "world_size=2", "task.size_mb=0.01,8", "task.iters=5",
                  "task.warmup_iters=1", "task.time_budget_s=5", "logger=none", tmp_path=coll, multirun=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the example model, as the jobs validate trains: a profile replays jobs of its own model only
    proc = launch(EXAMPLES, *FAST, "model=tied_gpt", "train.steps=6", "strategy=overlap", "profile=true",
                  "logger=none", tmp_path=prof)
    assert proc.returncode == 0, proc.stderr[-2000:]
    phases = json.loads((prof / "run" / "phases.json").read_text())
    assert len(phases["ranks"]) == 2 and len(phases["ranks"][0]) == 6
    assert all(t is not None for t in phases["ranks"][0][-1]["ready_ms"])  # every gradient's ready time
    assert [len(r) for r in phases["compute_alone"]] == [10, 10]  # forward and backward with no comm in flight
    assert all(p["forward_ms"] > 0 and p["backward_ms"] > 0 for r in phases["compute_alone"] for p in r)
    assert all(p["numel"] == math.prod(p["shape"]) for p in phases["params"])  # powersgd's matrices
    shutil.copytree(examples_sweep["bucketed"].parent, train / "multirun")  # validate reads one folder tree

    model = tmp_path / "model.json"  # the command's own code, in this process (its entry: test_predict.py)
    assert predict(["fit", str(coll / "multirun"), str(prof / "run"), "-o", str(model)]) == 0
    fitted = json.loads(model.read_text())
    assert fitted["compute"]["strategy"] == "overlap"
    assert fitted["contention"]["identified_by"].startswith("compute_alone") and fitted["contention"]["launch_ms"] >= 0
    work = fitted["host"]["powersgd"]  # its compressed step's work on the model's matrices, timed on this host
    assert work["numel"] == sum(p["numel"] for p in phases["params"] if len(p["shape"]) >= 2)
    assert len(work["phase_ms"]) == 3 and min(work["phase_ms"]) > 0
    compressed = json.loads((train / "multirun" / "1" / "results.json").read_text())["config"]  # bucketed
    compressed["strategy"] = {"name": "powersgd", "bucket_mb": 25.0, "rank": 1, "start_iter": 0}
    step, replayed = job_step(fitted, compressed)
    assert any(c.label == "phase 3 work" for c in step.collectives) and replayed.step_ms > 0
    capsys.readouterr()
    assert predict(["validate", str(model), str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any("fsdp" in line for line in lines) and any("overlap" in line for line in lines)
    example = next(line for line in lines if "bucketed_after_backward" in line)
    assert "not predicted" not in example and "error" not in example.lower(), example
    scores = next(i for i, line in enumerate(lines) if line.startswith("mean |error|: step "))
    assert "exposed comm" in lines[scores] and lines[scores + 1].strip().split(":")[0] in {*examples_sweep, "overlap"}
