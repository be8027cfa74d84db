"""Checkpoints through launch.py, against the ladder's jobs (tests/e2e/conftest.py: FAST, 4 steps, a
checkpoint after steps 2 and 4): a crashed rank costs a restart, not the run, and another strategy at
another world size goes on from a job's checkpoint."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.launching import FAST, launch, results

pytestmark = pytest.mark.slow


def test_a_crashed_rank_restarts_from_the_newest_checkpoint_and_ends_as_if_nothing_happened(tmp_path, ladder):
    proc = launch(*FAST, "logger=none", "train.save_model=true", "strategy=zero2", "checkpoint.every=2",
                  "fault.kind=crash", "fault.rank=1", "fault.step=3", "launcher.max_restarts=1", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = tmp_path / "run"
    record = results(job)
    assert record["status"] == "ok"
    (restart,) = record["summary"]["restarts"]
    assert (restart["restart"], restart["resumed_from_step"], restart["failed_after_step"]) == (1, 2, 2)
    assert restart["steps_recomputed"] == 1 and restart["seconds_lost"] > restart["recomputed_s"] > 0
    assert record["summary"]["resumed_from"]["step"] == 2 and [s["step"] for s in record["steps"]] == [2, 3]
    mine, theirs = torch.load(job / "model.pt"), torch.load(ladder["zero2"] / "model.pt")
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)  # the same arithmetic: bit for bit
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == ["step_2", "step_4"]  # checkpoint.keep=2


def test_another_strategy_at_another_world_size_goes_on_from_a_jobs_checkpoint(tmp_path, ladder):
    fsdp = ladder["fsdp"]
    proc = launch(*FAST, "logger=none", "strategy=bucketed", "world_size=4",
                  f"checkpoint.load={fsdp / 'checkpoints' / 'step_2'}", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    record = results(tmp_path / "run")
    loaded = record["summary"]["resumed_from"]
    assert (loaded["step"], loaded["strategy"], loaded["world_size"]) == (2, "fsdp", 2)
    assert [s["step"] for s in record["steps"]] == [2, 3]
    # the same weights and optimizer state on the same batch: step 2's loss is fsdp's, to rounding
    theirs = {s["step"]: s["loss"] for s in results(fsdp)["steps"]}
    assert record["steps"][0]["loss"] == pytest.approx(theirs[2], abs=1e-5)
    assert not (tmp_path / "run" / "checkpoints").exists()
