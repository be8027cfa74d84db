"""train.precision bf16 and fp16 through launch.py for every registered strategy: each job ends ok and
its loss falls (one sweep per precision); measure.grad_error records each step's error of the
gradient sync against the exact fp32 average of the same gradients (0 here: the averaging itself is
exact in fp32, whatever the compute precision; a sweep of its own, as ZeRO-3 strategies refuse it).

fp16 for powersgd and local_sgd runs in tests/e2e/test_compression_launch.py (with grad_error), and for
fsdp and fsdp_torch in tests/e2e/test_fsdp_launch.py: the fp16 sweep here leaves them out rather than
start the same jobs twice (each costs seconds of start-up)."""

import json

import pytest

from tests.helpers.extras import runnable_specs
from tests.helpers.launching import launch, results

pytestmark = pytest.mark.slow

FP16_ELSEWHERE = {"powersgd", "local_sgd", "fsdp", "fsdp_torch"}  # module docstring
# DeepSpeed's stages run fp32 only here (refused before launch otherwise: tests/parity/test_deepspeed.py)
REGISTERED = [s for s in runnable_specs() if not s.startswith("deepspeed_")]
PRECISIONS = ["bf16", "fp16"]
STRATEGIES = {"bf16": list(REGISTERED), "fp16": [s for s in REGISTERED if s not in FP16_ELSEWHERE]}
GRAD_ERROR_STRATEGIES = ["naive", "zero2"]  # a plain and a sharded sync


def _sweep(tmp, *overrides):
    proc = launch("model=toy", "train.steps=6", "train.warmup_steps=1", "train.batch_size=4", "train.lr=1e-2",
                  "logger=none", *overrides, tmp_path=tmp, multirun=True, timeout=290)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = {}
    for job in sorted((tmp / "multirun").iterdir()):
        if (job / "results.json").exists():
            cfg = results(job)["config"]
            jobs[cfg["strategy"]["name"], cfg["train"]["precision"]] = job
    return jobs


@pytest.fixture(scope="module", params=PRECISIONS)
def sweep(request, tmp_path_factory):
    return request.param, _sweep(tmp_path_factory.mktemp(f"precision_{request.param}"),
                                 f"strategy={','.join(STRATEGIES[request.param])}", f"train.precision={request.param}")


@pytest.fixture(scope="module")
def grad_error_sweep(tmp_path_factory):
    return _sweep(tmp_path_factory.mktemp("grad_error"), "measure.grad_error=true",
                  f"strategy={','.join(GRAD_ERROR_STRATEGIES)}", f"train.precision={','.join(PRECISIONS)}")


def test_every_strategy_trains_in_bf16_and_fp16(sweep):
    precision, jobs = sweep
    assert {s for s, _ in jobs} == set(STRATEGIES[precision]) and len(jobs) == len(STRATEGIES[precision])
    for key, job in jobs.items():
        result = results(job)
        assert result["status"] == "ok", key
        losses = [s["loss"] for s in result["steps"]]
        assert losses[-1] < losses[0], (key, losses)
        assert result["summary"]["final_loss"] == losses[-1]


def test_grad_error_per_step_in_results_and_steps_jsonl(grad_error_sweep):
    assert len(grad_error_sweep) == len(GRAD_ERROR_STRATEGIES) * len(PRECISIONS)
    for key, job in grad_error_sweep.items():
        steps = [json.loads(line) for line in (job / "steps.jsonl").read_text().splitlines()]
        errors = [s["grad_error"] for s in steps]
        assert len(errors) == 6 and all(0 <= e < 1e-6 for e in errors), (key, errors)
        assert results(job)["summary"]["grad_error"]["max"] < 1e-6
        if key[1] == "fp16":
            assert all(s["loss_scale"] > 0 for s in steps)


def test_every_registered_strategy_runs_in_both_precisions_somewhere():
    """The fp16 jobs left out here exist in the files the module docstring names."""
    from pathlib import Path

    here = Path(__file__).parent
    elsewhere = (here / "test_compression_launch.py").read_text() + (here / "test_fsdp_launch.py").read_text()
    assert set(STRATEGIES["bf16"]) == set(REGISTERED)
    assert set(STRATEGIES["fp16"]) | FP16_ELSEWHERE == set(REGISTERED)
    assert "train.precision=fp16" in elsewhere
    assert all(f"strategy={s}" in elsewhere or f'"{s}"' in elsewhere for s in FP16_ELSEWHERE)
