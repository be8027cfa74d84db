"""zero1 through launch.py trains to the same weights as bucketed (and as torch's ZeRO reference), holding
about half the optimizer state per rank at 2 ranks. The session's ladder sweep (tests/e2e/conftest.py) serves
it. zero1's reduce-scatter mode: its parity with plain AdamW and SGD is tests/parity/test_sharded_optimizer.py's,
its memory tests/parity/test_memory_census.py's."""

import pytest

from tests.helpers.launching import assert_same_saved_weights, results

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["zero1", "zero1_torch"])
def test_zero1_matches_bucketed_through_launch(ladder, name):
    assert results(ladder[name])["status"] == "ok"
    assert_same_saved_weights(ladder[name], ladder["bucketed"])
    full = results(ladder["bucketed"])["summary"]["memory"]["optimizer_state_max_rank"]
    assert results(ladder[name])["summary"]["memory"]["optimizer_state_max_rank"] < 0.6 * full
