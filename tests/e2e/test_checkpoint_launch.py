"""Checkpoints through launch.py: a crashed rank costs a restart, not the run, and another strategy at
another world size goes on from a job's checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.launching import launch, results

pytestmark = pytest.mark.slow
RUN = ["model=toy", "train.steps=8", "train.warmup_steps=1", "train.batch_size=12", "logger=none",
       "train.save_model=true", "checkpoint.every=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """zero2 at 2 ranks, 8 steps, a checkpoint every 2 (the newest 2 kept)."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = launch(*RUN, "strategy=zero2", tmp_path=tmp)
    assert proc.returncode == 0, proc.stderr
    return tmp / "run"


def test_a_crashed_rank_restarts_from_the_newest_checkpoint_and_ends_as_if_nothing_happened(tmp_path, reference):
    proc = launch(*RUN, "strategy=zero2", "fault.kind=crash", "fault.rank=1", "fault.step=5",
                  "launcher.max_restarts=1", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = tmp_path / "run"
    record = results(job)
    assert record["status"] == "ok"
    (restart,) = record["summary"]["restarts"]
    assert (restart["restart"], restart["resumed_from_step"], restart["failed_after_step"]) == (1, 4, 4)
    assert restart["steps_recomputed"] == 1 and restart["seconds_lost"] > restart["recomputed_s"] > 0
    assert record["summary"]["resumed_from"]["step"] == 4 and [s["step"] for s in record["steps"]] == [4, 5, 6, 7]
    mine, theirs = torch.load(job / "model.pt"), torch.load(reference / "model.pt")
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)  # the same arithmetic: bit for bit
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == ["step_6", "step_8"]  # checkpoint.keep=2


def test_another_strategy_at_another_world_size_goes_on_from_a_jobs_checkpoint(tmp_path, reference):
    proc = launch(*RUN, "strategy=bucketed", "world_size=3", f"checkpoint.load={reference / 'checkpoints' / 'step_6'}",
                  "checkpoint.every=0", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    record = results(tmp_path / "run")
    loaded = record["summary"]["resumed_from"]
    assert (loaded["step"], loaded["strategy"], loaded["world_size"]) == (6, "zero2", 2)
    assert [s["step"] for s in record["steps"]] == [6, 7]
    # the same weights and optimizer state on the same batch: step 6's loss is the reference's, to rounding
    theirs = {s["step"]: s["loss"] for s in json.loads((reference / "results.json").read_text())["steps"]}
    assert record["steps"][0]["loss"] == pytest.approx(theirs[6], abs=1e-5)
    assert not (tmp_path / "run" / "checkpoints").exists()
