"""fsdp and fsdp_torch through launch.py: the same weights (the consolidated checkpoint of
train.save_model), about 1/N of the model state per rank, the peak gathered for fsdp, and both on the
report's ladder, read from the session's ladder sweep (tests/e2e/conftest.py); hsdp at 4 ranks holding
1/shard_size. Their fp16 compute (each casts itself; the loss scaler unscales fsdp's shards and FSDP2's
DTensor local shards) is tests/parity/test_precision_every_strategy.py's, built as a job builds it."""

import pytest

from ddp_lab.analysis.report import make_report
from tests.helpers.launching import assert_same_saved_weights, results

pytestmark = pytest.mark.slow


@pytest.fixture
def sweep(ladder):
    return {name: ladder[name] for name in ("fsdp", "fsdp_torch")}


def test_fsdp_trains_to_fsdp_torchs_weights(sweep):
    assert_same_saved_weights(sweep["fsdp"], sweep["fsdp_torch"])


def test_model_state_is_sharded_and_the_peak_gathered_reported(sweep):
    for name, job in sweep.items():
        memory = results(job)["summary"]["memory"]
        assert memory["zero_stage"] == 3 and memory["expected_total"] == 16 * memory["num_params"] / 2
        assert 1.0 <= memory["model_state_ratio"] <= 1.05, name
    fsdp = results(sweep["fsdp"])["summary"]["memory"]
    assert 0 < fsdp["peak_gathered_bytes_max_rank"] < 4 * fsdp["num_params"]  # not the whole model


def test_report_has_both_on_the_ladder(sweep):
    report = make_report(sweep["fsdp"].parent, quiet=True)
    assert "report_ladder.png" in {p.name for p in report["png"]}
    assert {r["strategy"] for r in report["records"]} >= {"fsdp", "fsdp_torch"}


def test_hsdp_shards_within_its_groups(hsdp_at_four_ranks):
    """On one host with shard_size=2 at 4 ranks: 2 shard groups, 1/2 of the model state per rank. That it
    trains to torch's hybrid sharding's weights is tests/parity/test_hsdp.py's (2x2, 3x2, 2x3)."""
    res = results(hsdp_at_four_ranks)
    assert res["status"] == "ok" and res["env"]["world_size"] == 4
    memory = res["summary"]["memory"]
    assert memory["shard_ranks"] == 2 and memory["zero_stage"] == 3
    assert memory["expected_total"] == 16 * memory["num_params"] / 2 and 1.0 <= memory["model_state_ratio"] < 1.05


def test_logger_none_writes_no_wandb(hsdp_at_four_ranks):
    """The session's 4-rank hsdp job (tests/e2e/conftest.py) ran with logger=none."""
    assert results(hsdp_at_four_ranks)["env"]["world_size"] == 4
    assert not (hsdp_at_four_ranks / "wandb").exists()
