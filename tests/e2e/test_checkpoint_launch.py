"""Checkpoints through launch.py, against the ladder's jobs (tests/e2e/conftest.py: FAST, 4 steps, a
checkpoint after steps 2 and 4): one job goes on from another strategy's checkpoint and loses a rank on the
way, which costs a restart, not the run."""

from __future__ import annotations

import pytest

from tests.helpers.launching import FAST, assert_same_saved_weights, launch, results

pytestmark = pytest.mark.slow


def test_a_job_goes_on_from_another_strategys_checkpoint_and_recovers_from_a_crashed_rank(tmp_path, ladder):
    """bucketed starts from fsdp's checkpoint after step 2; rank 1 crashes in step 3, before bucketed's own
    first checkpoint, so the restarted workers load fsdp's again: the job ends ok where bucketed's own 4
    steps end (to float32 rounding: fsdp summed the first two steps' gradients in another order)."""
    fsdp = ladder["fsdp"]
    proc = launch(*FAST, "logger=none", "train.save_model=true", "strategy=bucketed", "checkpoint.every=2",
                  f"checkpoint.load={fsdp / 'checkpoints' / 'step_2'}", "fault.kind=crash", "fault.rank=1",
                  "fault.step=3", "launcher.max_restarts=1", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = tmp_path / "run"
    record = results(job)
    assert record["status"] == "ok"
    loaded = record["summary"]["resumed_from"]
    assert (loaded["step"], loaded["strategy"], loaded["world_size"]) == (2, "fsdp", 2)
    (restart,) = record["summary"]["restarts"]
    assert (restart["restart"], restart["resumed_from_step"], restart["failed_after_step"]) == (1, 2, 2)
    assert restart["steps_recomputed"] == 1 and restart["seconds_lost"] > restart["recomputed_s"] > 0
    assert [s["step"] for s in record["steps"]] == [2, 3]
    # the same weights and optimizer state on the same batch: step 2's loss is fsdp's, to rounding
    theirs = {s["step"]: s["loss"] for s in results(fsdp)["steps"]}
    assert record["steps"][0]["loss"] == pytest.approx(theirs[2], abs=1e-5)
    assert_same_saved_weights(job, ladder["bucketed"])
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == ["step_4"]  # its own, after the last step


def test_the_ladders_saves_record_what_the_loop_waited_for(ladder):
    """checkpoint.async_save: after step 1 the loop waits for a copy (its memory recorded), not for the bytes
    to be written; the last save is written before the run ends, its bytes recorded."""
    from ddp_lab.spec.figures import CHECKPOINT_BYTES, CHECKPOINT_MEMORY, CHECKPOINT_SAVE, CHECKPOINT_STAGED

    steps = {s["step"]: s for s in results(ladder["fsdp"])["steps"]}
    keys = (CHECKPOINT_SAVE.key, CHECKPOINT_BYTES.key, CHECKPOINT_MEMORY.key, CHECKPOINT_STAGED.key)
    saves = {step: {k for k in keys if k in s} for step, s in steps.items()}
    assert saves == {0: set(), 1: {CHECKPOINT_SAVE.key, CHECKPOINT_MEMORY.key, CHECKPOINT_STAGED.key}, 2: set(),
                     3: {CHECKPOINT_SAVE.key, CHECKPOINT_BYTES.key, CHECKPOINT_MEMORY.key}}
    # fsdp's shards of parameters and AdamW's two moments, fp32, and the steps and random state beside them
    assert steps[1][CHECKPOINT_STAGED.key] >= 3 * 4 * results(ladder["fsdp"])["summary"]["memory"]["num_params"] / 2
    assert steps[1][CHECKPOINT_MEMORY.key] >= 0 and steps[3][CHECKPOINT_BYTES.key] > 0
    assert sorted(p.name for p in (ladder["fsdp"] / "checkpoints").iterdir()) == ["step_2", "step_4"]
