"""powersgd's and local_sgd's knobs: the defaults compose and validate, bad values are refused before
launch with a line that names the knob (nothing is launched here)."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from ddp_lab.config import register_configs
from ddp_lab.launcher.config_checks import validate
from ddp_lab.launcher.preflight import EXIT_BAD_INPUT, check_command_line

CONF = Path(__file__).resolve().parents[2] / "conf"
register_configs()


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_defaults():
    p, s = _compose("strategy=powersgd").strategy, _compose("strategy=local_sgd").strategy
    assert (p.rank, p.start_iter, p.bucket_mb) == (1, 10, 25)
    assert (s.sync_every, str(s.outer)) == (4, "none")


@pytest.mark.parametrize("overrides, message", [
    (["strategy=powersgd", "strategy.rank=0"], "strategy.rank must be >= 1, got 0"),
    (["strategy=powersgd", "strategy.rank=-3"], "strategy.rank must be >= 1, got -3"),
    (["strategy=powersgd", "strategy.start_iter=-1"], "strategy.start_iter must be >= 0, got -1"),
    (["strategy=powersgd", "strategy.bucket_mb=0"], "strategy.bucket_mb must be > 0"),
    (["strategy=powersgd", "strategy.sync_every=2"], "strategy.sync_every is not a knob of strategy=powersgd"),
    (["strategy=local_sgd", "strategy.sync_every=0"], "strategy.sync_every must be >= 1, got 0"),
    (["strategy=local_sgd", "strategy.comm_dtype=bf16"], "strategy.comm_dtype does not apply to strategy=local_sgd"),
    (["strategy=local_sgd", "strategy.rank=2"], "strategy.rank is not a knob of strategy=local_sgd"),
    (["strategy=bucketed", "strategy.outer=nesterov"], "strategy.outer is not a knob of strategy=bucketed"),
])
def test_bad_values_are_refused_in_one_line(overrides, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:  # the check launch.py makes: Hydra's schema, then validate
        check_command_line(CONF, "config", [*overrides, f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert exit_.value.code == EXIT_BAD_INPUT and message in err and err.count("\n") == 1, err


def test_unknown_outer_is_refused_by_the_schema():
    with pytest.raises(ConfigCompositionException) as info:
        _compose("strategy=local_sgd", "strategy.outer=adam")
    assert "expected one of [none, nesterov]" in str(info.value.__cause__ or info.value)


def test_good_values_validate():
    validate(_compose("strategy=powersgd", "strategy.rank=4", "strategy.start_iter=0"))
    validate(_compose("strategy=local_sgd", "strategy.sync_every=1", "strategy.outer=nesterov"))
