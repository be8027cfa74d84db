"""powersgd and local_sgd through launch.py on the tiny Transformer: the loss falls, and the bytes on
the wire are what the strategy planned (a fraction of a gradient all-reduce's)."""

import pytest

from tests.helpers.launching import launch, results

pytestmark = pytest.mark.slow

SHORT = ["model=tiny", "model.context_length=16", "train.steps=16", "train.warmup_steps=2", "train.batch_size=4",
         "train.lr=3e-3", "logger=none"]
RUNS = {"powersgd": ["strategy=powersgd", "strategy.rank=4", "strategy.start_iter=4"],
        "local_sgd": ["strategy=local_sgd", "strategy.sync_every=4", "strategy.outer=nesterov"]}


@pytest.fixture(scope="module", params=list(RUNS))
def run(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    proc = launch(*SHORT, *RUNS[request.param], tmp_path=tmp)
    assert proc.returncode == 0, proc.stderr
    out = results(tmp / "run")
    assert out["status"] == "ok"
    return request.param, out


def test_loss_falls(run):
    _, out = run
    losses = [s["loss"] for s in out["steps"]]
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses


def test_bytes_on_the_wire_are_the_planned_fraction(run):
    name, out = run
    facts, steps, summary = out["summary"]["strategy_facts"], out["steps"], out["summary"]
    if name == "powersgd":
        plan = facts["powersgd"]
        assert [s["comm_bytes"] for s in steps] == [plan["bytes_plain_step"]] * 4 + [plan["bytes_compressed_step"]] * 12
        assert plan["bytes_compressed_step"] <= 0.25 * plan["bytes_plain_step"]
        assert plan["compression_ratio"] == pytest.approx(plan["bytes_plain_step"] / plan["bytes_compressed_step"])
    else:
        per_sync = facts["local_sgd"]["bytes_per_sync"]
        assert [s["comm_bytes"] for s in steps] == [per_sync if (s["step"] + 1) % 4 == 0 else 0 for s in steps]
        # the summary's mean over the measured steps (2-15): syncs after steps 3, 7, 11 and 15
        assert summary["comm_bytes_per_step"] == pytest.approx(per_sync * 4 / 14)
        assert summary["comm_bytes_per_step"] <= 0.30 * per_sync


@pytest.mark.parametrize("strategy", [["strategy=powersgd", "strategy.start_iter=2", "strategy.rank=2"],
                                      ["strategy=local_sgd", "strategy.sync_every=2"]], ids=["powersgd", "local_sgd"])
def test_fp16_with_grad_error(strategy, tmp_path):
    """fp16 compute (loss scaling) runs ok and learns; grad_error shows what each strategy delivers: powersgd
    the exact average on its plain steps and an approximation after, local_sgd each rank's own gradient."""
    proc = launch("model=toy", "train.steps=6", "train.warmup_steps=1", "train.batch_size=4", "train.lr=1e-2",
                  "logger=none", "measure.grad_error=true", "train.precision=fp16", *strategy, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = results(tmp_path / "run")
    losses, errors = [s["loss"] for s in out["steps"]], [s["grad_error"] for s in out["steps"]]
    assert out["status"] == "ok" and losses[-1] < losses[0], losses
    if strategy[0] == "strategy=powersgd":
        assert max(errors[:2]) < 1e-6, errors
    assert all(e > 1e-3 for e in errors[2:]), errors
