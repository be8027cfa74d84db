"""A checkpoint is complete or absent, and a load that cannot fit is refused in one line before any rank
starts: the job folder's checkpoint bookkeeping (jobdir.py) and launch.py's check on fabricated folders."""

from __future__ import annotations

import json

import pytest

from ddp_lab.config import register_configs
from ddp_lab.jobdir import CHECKPOINT_META, checkpoint_path, complete_checkpoints, newest_checkpoint
from ddp_lab.launcher.preflight import EXIT_BAD_INPUT, check_command_line
from tests.helpers.launching import ROOT

register_configs()
TOY = {"embed.weight": [1000, 64]}  # fabricated: the check reads only checkpoint.json's shapes


def _checkpoint(job, step, complete=True, **meta):
    path = checkpoint_path(job, step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")  # DCP's
    if complete:
        (path / CHECKPOINT_META).write_text(json.dumps({"format": 1, "step": step, "shapes": TOY, **meta}))
    return path


def test_only_complete_checkpoints_are_taken(tmp_path):
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 6, complete=False)            # checkpoint.json not written: the save was killed
    partial = checkpoint_path(tmp_path, 8).with_name("step_8.partial")
    partial.mkdir()                                      # a save in progress, never renamed
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [2]
    assert newest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 2)
    assert newest_checkpoint(checkpoint_path(tmp_path, 2)) == checkpoint_path(tmp_path, 2)
    assert newest_checkpoint(checkpoint_path(tmp_path, 6)) is None


def _refused(tmp_path, capsys, *overrides) -> str:
    args = ["model=toy", "train.steps=10", "train.warmup_steps=1", *overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    with pytest.raises(SystemExit) as exit_:
        check_command_line(ROOT / "conf", "config", args)
    assert exit_.value.code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("case, phrase", [
    ("incomplete", "no complete checkpoint there"),
    ("other_model", "it is of another model"),
    ("newer", "checkpoint format 9 is newer than this version's"),
    ("too_late", "leaves 1 steps, not more than train.warmup_steps=1"),
])
def test_a_checkpoint_that_cannot_load_is_refused_before_launch(tmp_path, capsys, case, phrase):
    import torch

    from ddp_lab.config import compose_model
    from ddp_lab.models import build_model
    with torch.device("meta"):
        shapes = {n: list(p.shape) for n, p in build_model(compose_model("toy")).named_parameters()}
    job = tmp_path / "job"
    meta = {"shapes": shapes}
    if case == "incomplete":
        _checkpoint(job, 4, complete=False, **meta)
    elif case == "other_model":
        _checkpoint(job, 4, shapes={**shapes, "extra.weight": [3]})
    elif case == "newer":
        _checkpoint(job, 4, format=9, **meta)
    else:
        _checkpoint(job, 9, **meta)
    assert phrase in _refused(tmp_path, capsys, f"checkpoint.load={job}")


def test_a_checkpoint_in_a_strategys_own_format_loads_only_into_it():
    from ddp_lab.jobdir import own_format_problem

    theirs = {"strategy": "deepspeed_zero2", "world_size": 2, "own_format": "deepspeed"}
    assert own_format_problem(theirs, "deepspeed_zero2", "deepspeed", 2) is None
    assert own_format_problem(theirs, "deepspeed_zero2", "deepspeed", 3) == (
        "it is in deepspeed's own format, written by strategy=deepspeed_zero2 at 2 ranks, which loads only there")
    assert "written by strategy=deepspeed_zero2 at 2 ranks" in own_format_problem(theirs, "bucketed", None, 2)
    pieces = {"strategy": "bucketed", "world_size": 2}
    assert own_format_problem(pieces, "fsdp", None, 3) is None
    assert own_format_problem(pieces, "deepspeed_zero1", "deepspeed", 2) == (
        "strategy=deepspeed_zero1 loads only its own checkpoints (deepspeed's format), and this one holds "
        "bucketed's pieces")
