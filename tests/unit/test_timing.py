"""StepTimer's laps, and reduce_over_ranks: a step's time is the slowest rank's, its loss and phases the mean."""

import time

import pytest
import torch

from ddp_lab.check.ranks import run_ranks
from ddp_lab.rank.timing import StepTimer, reduce_over_ranks
from ddp_lab.spec.figures import figure


def test_laps_split_the_step_and_add_up_to_it():
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    time.sleep(0.02)
    timer.lap("fwd_bwd_ms")
    time.sleep(0.01)
    timer.lap("sync_ms")
    total = timer.stop_ms()
    assert list(timer.laps) == ["fwd_bwd_ms", "sync_ms"]
    assert timer.laps["fwd_bwd_ms"] >= 20.0 and timer.laps["sync_ms"] >= 10.0
    assert sum(timer.laps.values()) <= total
    timer.start()
    assert timer.laps == {}  # a new step starts with no laps


def _reduce(rank, world_size):
    local = {"step_time_ms": 10.0 * (rank + 1), "loss": float(rank), "fwd_bwd_ms": 4.0 * (rank + 1),
             "comm_ms": 1.0 + rank, "exposed_comm_ms": 5.0 - rank, "collectives": 3 + rank}
    return reduce_over_ranks(local, torch.device("cpu"))


def test_max_for_timings_mean_for_loss_and_phases():
    out = run_ranks(_reduce, 3)
    assert out[0] == out[1] == out[2]  # every rank gets the same figures
    figures = out[0]
    assert figures["step_time_ms"] == 30.0       # the slowest rank: a step ends when the last rank does
    assert figures["comm_ms"] == 3.0
    # exposed: the most-waiting rank's, and the least-waiting one's beside it (the others' skew apart)
    assert (figures["exposed_comm_ms"], figures["exposed_comm_min_rank_ms"]) == (5.0, 3.0)
    assert figures["loss"] == pytest.approx(1.0)     # the mean of 0, 1, 2: each rank's loss is over its slice
    assert figures["fwd_bwd_ms"] == pytest.approx(8.0)  # phases: rank means, so they add up to a step
    assert figures["collectives"] == 5 and isinstance(figures["collectives"], int)
    assert figure("loss").ranks == figure("fwd_bwd_ms").ranks == "mean" and figure("step_time_ms").ranks == "max"


def _unknown(rank, world_size):
    try:
        reduce_over_ranks({"step_time_ms": 1.0, "made_up_ms": 2.0}, torch.device("cpu"))
    except KeyError as exc:
        return str(exc)
    return None


def test_a_figure_without_a_row_in_the_table_is_refused():
    """Adding a per-step figure is its code and one row of spec/figures.py: the reduction refuses one with none."""
    assert all("made_up_ms" in out and "spec/figures.py" in out for out in run_ranks(_unknown, 2))
