"""`train.compile=true` through launch.py: compiled jobs end ok with how long compiling took in their summary, and
the compiled weights equal the uncompiled job's; a strategy that cannot compile is refused before launch, saying
why (tests/parity/test_compile.py holds every strategy's parity)."""

import math

import pytest

from tests.helpers.launching import FAST, assert_same_saved_weights, launch, results

pytestmark = pytest.mark.slow


def test_compiled_jobs_record_their_compile_time_and_train_as_eager_ones(tmp_path):
    """One sweep (one strategy: tests/parity/test_compile.py holds every one), compiled and eager."""
    proc = launch(*FAST, "logger=none", "train.save_model=true", "strategy=bucketed", "train.compile_backend=aot_eager",
                  "train.compile=true,false", tmp_path=tmp_path, multirun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled, eager = (tmp_path / "multirun" / str(job) for job in range(2))
    record = results(compiled)
    summary = record["summary"]
    assert record["status"] == "ok", record["error"]
    assert summary["compile"]["backend"] == "aot_eager" and summary["compile"]["compile_s"] > 0, summary["compile"]
    assert summary["compile"]["first_step_ms"] > summary["step_time_ms"]["p50"]
    assert math.isfinite(summary["final_loss"])
    assert results(eager)["summary"]["compile"] is None
    assert_same_saved_weights(compiled, eager)
