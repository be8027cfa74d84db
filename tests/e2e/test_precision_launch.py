"""train.precision=bf16 through launch.py: zero2 (a sharded sync, its gradients through the lab's
reduce-scatter rings) with measure.grad_error: the job ends ok, its loss falls, and each step's error of
the gradient sync against the exact fp32 average of the same gradients is recorded (0 here: the averaging
itself is exact in fp32, whatever the compute precision).

fp16 with its loss scale through launch.py: powersgd and local_sgd, with grad_error, in
tests/e2e/test_compression_launch.py. Every registered strategy in both precisions is
tests/parity/test_precision_every_strategy.py's (in one set of rank processes, built as a job builds it:
fsdp and fsdp_torch cast themselves)."""

import json

import pytest

from tests.helpers.launching import launch, results

pytestmark = pytest.mark.slow

PRECISIONS = ["bf16"]
GRAD_ERROR_STRATEGIES = ["zero2"]


@pytest.fixture(scope="module")
def grad_error_sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grad_error")
    proc = launch("model=toy", "train.steps=6", "train.warmup_steps=1", "train.batch_size=4", "train.lr=1e-2",
                  "logger=none", "measure.grad_error=true", f"strategy={','.join(GRAD_ERROR_STRATEGIES)}",
                  f"train.precision={','.join(PRECISIONS)}", tmp_path=tmp, multirun=True, timeout=290)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = {}
    for job in sorted((tmp / "multirun").iterdir()):
        if (job / "results.json").exists():
            cfg = results(job)["config"]
            jobs[cfg["strategy"]["name"], cfg["train"]["precision"]] = job
    return jobs


def test_bf16_trains_through_launch(grad_error_sweep):
    assert set(grad_error_sweep) == {(s, p) for s in GRAD_ERROR_STRATEGIES for p in PRECISIONS}
    for key, job in grad_error_sweep.items():
        result = results(job)
        assert result["status"] == "ok", key
        losses = [s["loss"] for s in result["steps"]]
        assert losses[-1] < losses[0], (key, losses)
        assert result["summary"]["final_loss"] == losses[-1]


def test_grad_error_per_step_in_results_and_steps_jsonl(grad_error_sweep):
    for key, job in grad_error_sweep.items():
        steps = [json.loads(line) for line in (job / "steps.jsonl").read_text().splitlines()]
        errors = [s["grad_error"] for s in steps]
        assert len(errors) == 6 and all(0 <= e < 1e-6 for e in errors), (key, errors)
        assert results(job)["summary"]["grad_error"]["max"] < 1e-6
