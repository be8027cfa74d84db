"""A strategy and a model from outside the package (examples/): launch.py runs them from the user's own
config folder (hydra.searchpath), they train to the weights an in-package strategy reaches, and
`python -m ddp_lab.check` passes the strategy's runtime class on every case. (`predict validate`
replaying its declared schedule: tests/e2e/test_predict_launch.py.)"""

import pytest

from ddp_lab.check.__main__ import main as check
from tests.helpers.launching import FAST, ROOT, assert_same_saved_weights, launch, results

EXAMPLES = f"hydra.searchpath=[file://{ROOT / 'examples' / 'conf'}]"


@pytest.mark.slow
def test_the_example_strategy_and_model_train_through_launch(tmp_path):
    strategies = ["bucketed_after_backward", "bucketed", "fsdp"]
    proc = launch(EXAMPLES, *FAST, "model=tied_gpt", "logger=none", "train.save_model=true",
                  f"strategy={','.join(strategies)}", tmp_path=tmp_path, multirun=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = {name: tmp_path / "multirun" / str(i) for i, name in enumerate(strategies)}
    example = results(jobs["bucketed_after_backward"])
    assert example["status"] == "ok" and example["config"]["model"]["name"] == "tied_gpt"
    spec = "examples.bucketed_after_backward.spec.BucketedAfterBackwardSpec"
    assert example["config"]["strategy"]["_target_"] == spec
    assert example["summary"]["exposed_comm_ms"]["p50"] > 0 and example["summary"]["overlap_pct"] == 0.0
    for name in ("bucketed", "fsdp"):  # a tied embedding and head, sharded by fsdp too
        assert_same_saved_weights(jobs["bucketed_after_backward"], jobs[name])


def test_a_bad_knob_of_the_example_is_refused_before_launch(tmp_path):
    proc = launch(EXAMPLES, "strategy=bucketed_after_backward", "strategy.bucket_mb=0", tmp_path=tmp_path)
    assert proc.returncode == 2 and "strategy.bucket_mb must be > 0, got 0" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_the_example_strategy_passes_the_conformance_check(capsys):
    code = check(["examples.bucketed_after_backward.strategy.BucketedAfterBackward", "--world-size", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("  ok ") == 7 and "skip" not in out and "FAIL" not in out
