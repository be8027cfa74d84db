"""strategy=local_sgd_torchft through launch.py beside strategy=local_sgd with the same knobs (streaming: 2
fragments, a delay, outer Nesterov; AdamW inner) on data=text at 2 ranks, one sweep: the two loss curves are one
curve (same data, same start, the same rule: the parameters agree to float rounding,
tests/parity/test_local_sgd_torchft.py), and so are the bytes each sends per step. Without torchft the
option is refused before launch, in one line; with it, its own constraints are."""

import pytest

from ddp_lab.launcher.preflight import EXIT_BAD_INPUT, check_command_line
from tests.helpers.extras import requires_torchft
from tests.helpers.launching import NARROW, ROOT, launch, results

TEXT = ["data=text", "model=tiny", *NARROW, "model.context_length=16", "model.vocab_size=256", "train.steps=12",
        "train.warmup_steps=2", "train.batch_size=8", "train.lr=3e-3", "logger=none", "world_size=2",
        "strategy.sync_every=4", "strategy.fragments=2", "strategy.delay=1", "strategy.outer=nesterov"]


@pytest.mark.slow
@requires_torchft
def test_torchfts_run_is_ours(tmp_path):
    proc = launch(*TEXT, "strategy=local_sgd,local_sgd_torchft", tmp_path=tmp_path, multirun=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, theirs = results(tmp_path / "multirun" / "0"), results(tmp_path / "multirun" / "1")
    assert (ours["status"], theirs["status"]) == ("ok", "ok")
    assert theirs["summary"]["strategy_facts"]["local_sgd"]["implementation"] == "torchft"
    for a, b in zip(ours["steps"], theirs["steps"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])
        assert b["comm_bytes"] == a["comm_bytes"], a["step"]


def _refused(args, tmp_path, capsys) -> str:
    from ddp_lab.config import register_configs

    register_configs()
    with pytest.raises(SystemExit) as exit_:
        check_command_line(ROOT / "conf", "config", [*args, f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_.value.code == EXIT_BAD_INPUT
    assert not (tmp_path / "run").exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_without_torchft_it_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    assert "needs torchft, which is not installed" in _refused(["strategy=local_sgd_torchft"], tmp_path, capsys)


@pytest.mark.parametrize(("args", "message"), [
    (["strategy.sync_every=6", "strategy.fragments=4"], "must be a multiple of strategy.fragments=4"),
    (["strategy.sync_every=4", "strategy.fragments=2", "strategy.delay=2"], "must be below sync_every / fragments = 2"),
    (["network=emulated", "world_size=4"], "runs on the host network only"),
    (["checkpoint.every=2"], "takes no checkpoints here"),
])
def test_torchfts_own_constraints_are_refused(tmp_path, capsys, monkeypatch, args, message):
    """Its constraints are checked whether or not torchft is here (as if it were: nothing imports it before launch)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torchft" else real(name, *a))
    assert message in _refused(["strategy=local_sgd_torchft", *args], tmp_path, capsys)
