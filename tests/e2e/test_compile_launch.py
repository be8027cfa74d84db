"""`train.compile=true` through launch.py: compiled jobs end ok with how long compiling took in their summary, and
the compiled weights equal the uncompiled job's; a strategy that cannot compile is refused before launch, saying
why (tests/parity/test_compile.py holds every strategy's parity)."""

import math

import pytest

from tests.helpers.launching import FAST, assert_same_saved_weights, launch, results

pytestmark = pytest.mark.slow


def test_compiled_jobs_record_their_compile_time_and_train_as_eager_ones(tmp_path):
    run = [*FAST, "logger=none", "train.save_model=true", "strategy=bucketed", "train.compile_backend=aot_eager"]
    for folder in ("compiled", "eager"):
        (tmp_path / folder).mkdir()
    compiled = launch(*run, "train.compile=true", tmp_path=tmp_path / "compiled", multirun=True)
    eager = launch(*run, tmp_path=tmp_path / "eager", multirun=True)
    assert compiled.returncode == 0 and eager.returncode == 0, compiled.stderr + eager.stderr
    for job in range(1):  # one strategy: tests/parity/test_compile.py holds every one
        record = results(tmp_path / "compiled" / "multirun" / str(job))
        summary = record["summary"]
        assert record["status"] == "ok", record["error"]
        assert summary["compile"]["backend"] == "aot_eager" and summary["compile"]["compile_s"] > 0, summary["compile"]
        assert summary["compile"]["first_step_ms"] > summary["step_time_ms"]["p50"]
        assert math.isfinite(summary["final_loss"])
        assert results(tmp_path / "eager" / "multirun" / str(job))["summary"]["compile"] is None
        assert_same_saved_weights(tmp_path / "compiled" / "multirun" / str(job),
                                  tmp_path / "eager" / "multirun" / str(job))
