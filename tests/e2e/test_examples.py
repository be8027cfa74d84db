"""A strategy and a model from outside the package (examples/): launch.py runs them from the user's own
config folder (hydra.searchpath), they train to the weights an in-package strategy reaches, and
`python -m ddp_lab.check` passes the strategy's runtime class on every case. (`predict validate`
replaying its declared schedule: tests/e2e/test_predict_launch.py.)"""

import pytest

from ddp_lab.check.__main__ import main as check
from tests.helpers.launching import EXAMPLES, assert_same_saved_weights, launch, results


@pytest.mark.slow
def test_the_example_strategy_and_model_train_through_launch(examples_sweep):
    """The session's examples sweep (tests/e2e/conftest.py)."""
    example = results(examples_sweep["bucketed_after_backward"])
    assert example["status"] == "ok" and example["config"]["model"]["name"] == "tied_gpt"
    spec = "examples.bucketed_after_backward.spec.BucketedAfterBackwardSpec"
    assert example["config"]["strategy"]["_target_"] == spec
    assert example["summary"]["exposed_comm_ms"]["p50"] > 0 and example["summary"]["overlap_pct"] == 0.0
    for name in ("bucketed", "fsdp"):  # a tied embedding and head, sharded by fsdp too
        assert_same_saved_weights(examples_sweep["bucketed_after_backward"], examples_sweep[name])


def test_a_bad_knob_of_the_example_is_refused_before_launch(tmp_path):
    proc = launch(EXAMPLES, "strategy=bucketed_after_backward", "strategy.bucket_mb=0", tmp_path=tmp_path)
    assert proc.returncode == 2 and "strategy.bucket_mb must be > 0, got 0" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_the_example_strategy_passes_the_conformance_check_but_unused(capsys, tmp_path):
    """Every case at both bucket sizes; `unused` fails as it does for the lab's own bucketed strategies: the
    engine they share (strategies/overlap_engine.py) gives a parameter no rank used a zero gradient, which
    AdamW's weight decay moves and one process would not."""
    code = check(["examples.bucketed_after_backward.strategy.BucketedAfterBackward", "--world-size", "3",
                  "--logs", str(tmp_path / "logs")])  # a failing run keeps its logs: here, not in the system's temp
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if line.startswith("  FAIL")]
    assert code == 1 and out.count("  ok ") == 12, out
    assert [line.split()[3] for line in failed] == ["unused@25MB", "unused@small"], out
    assert all("the unused parameter moved" in line for line in failed)
    skipped = [line for line in out.splitlines() if line.startswith("  skip")]
    assert len(skipped) == 1 and " groups " in skipped[0]  # param groups: a sharded optimizer's case
