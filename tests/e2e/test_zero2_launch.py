"""zero2 through launch.py: bucketed's weights, half the gradients and optimizer state per rank, and
the report's measured-vs-paper table and ladder picture. The session's ladder sweep (tests/e2e/conftest.py)
serves every assertion."""

import pytest

from ddp_lab.analysis.report import make_report
from tests.helpers.launching import assert_same_saved_weights, results

pytestmark = pytest.mark.slow


@pytest.fixture
def sweep(ladder):
    return ladder


def test_zero2_trains_to_bucketeds_weights(sweep):
    assert_same_saved_weights(sweep["zero2"], sweep["bucketed"])


def test_memory_per_rank_against_the_zero_paper(sweep):
    full, sharded = (results(sweep[name])["summary"]["memory"] for name in ("bucketed", "zero2"))
    assert (full["zero_stage"], sharded["zero_stage"]) == (0, 2)
    assert full["num_params"] == sharded["num_params"] > 0
    # Both within the bar of their stage's figure: 16 and 4 + 12/2 = 10 bytes per parameter.
    assert full["expected_total"] == 16 * full["num_params"] and sharded["expected_total"] == 10 * full["num_params"]
    for memory in (full, sharded):
        assert 1.0 <= memory["model_state_ratio"] <= 1.05
        assert len(memory["per_rank"]) == 2
    for rank_full, rank_sharded in zip(full["per_rank"], sharded["per_rank"]):
        before_full, before_sharded = rank_full["before_step"], rank_sharded["before_step"]
        assert before_sharded["params"] == before_full["params"]  # stage 2 keeps every parameter
        # half the gradient and half the AdamW state, give or take the padding and Adam's step counters
        assert before_sharded["grads"] == pytest.approx(before_full["grads"] / 2, rel=0.01)
        assert before_sharded["optimizer_state"] == pytest.approx(before_full["optimizer_state"] / 2, rel=0.01)


def test_report_shows_measured_beside_paper_and_the_ladder(sweep):
    report = make_report(sweep["bucketed"].parent, quiet=True)
    assert "report_ladder.png" in {p.name for p in report["png"]}
    md = (sweep["bucketed"].parent / "report.md").read_text()
    assert "## Model state per rank: measured vs ZeRO paper" in md and "× ZeRO paper" in md
    by_strategy = {r["strategy"]: r for r in report["records"]}
    assert by_strategy["zero2"]["model_state_vs_paper"] == pytest.approx(
        results(sweep["zero2"])["summary"]["memory"]["model_state_ratio"])
    assert by_strategy["zero2"]["model_state_mib_per_rank"] < 0.7 * by_strategy["bucketed"]["model_state_mib_per_rank"]
