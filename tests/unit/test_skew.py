"""arithmetic/skew.py on hand-made stamps whose answer is known."""

from __future__ import annotations

import pytest

from ddp_lab.arithmetic.skew import (
    ISSUED_AFTER,
    ISSUED_LATE,
    LATE_PEER,
    QUEUED,
    aligned,
    blame,
    chance,
    exposure,
    exposure_table,
    late_arrivals,
    late_start_rule,
    lateness,
    node_stamps,
    per_collective,
    per_rank,
    step_evidence,
    step_figures,
    steps_needed,
    traceml_rule,
    verdict,
)

# 3 ranks, 2 collectives (seconds). Collective 0: rank 2 enters 30 ms after rank 0, 20 ms after rank 1; all complete
# 10 ms after rank 2 entered. Collective 1 (launched while 0 is in flight on rank 0): everyone within 1 ms.
STAMPS = [
    [(0.000, 0.040), (0.035, 0.050)],
    [(0.010, 0.040), (0.035, 0.050)],
    [(0.030, 0.040), (0.036, 0.050)],
]


def test_skew_and_transfer_add_up_to_the_most_waiting_ranks_time():
    first, second = per_collective(STAMPS)
    assert first["skew_ms"] == pytest.approx(30) and first["transfer_ms"] == pytest.approx(10)
    assert first["skew_ms"] + first["transfer_ms"] == pytest.approx(first["waited_ms"]) == pytest.approx(40)
    late_first, late_second = late_arrivals(STAMPS)
    held_ms = (late_first["entry"] - late_first["second"]) * 1e3
    assert late_first["rank"] == 2 and held_ms == pytest.approx(20)  # rank 1 was there 20 ms before it
    assert second["skew_ms"] == pytest.approx(1) and late_second["rank"] == 2


def test_a_ranks_waiting_and_transferring_add_up_to_its_comm_time():
    ranks = per_rank(STAMPS)
    # rank 0: waits 0-30 ms for collective 0; from 30 ms on it transfers (collective 1's own wait, 35-36 ms, is
    # inside collective 0's transfer: counted once, as transfer).
    assert ranks[0]["waiting_ms"] == pytest.approx(30) and ranks[0]["transferring_ms"] == pytest.approx(20)
    assert ranks[2]["waiting_ms"] == pytest.approx(0) and ranks[2]["transferring_ms"] == pytest.approx(20)
    for mine, figures in zip(STAMPS, ranks):
        comm = max(e for _, e in mine) - min(s for s, _ in mine)  # one unbroken span on every rank here
        assert figures["waiting_ms"] + figures["transferring_ms"] == pytest.approx(comm * 1e3)


def test_blame_is_what_the_last_rank_alone_held_the_others():
    assert blame(STAMPS) == pytest.approx([0, 0, 20 + 1])


def test_a_step_gives_its_skew_and_the_most_waiting_ranks_split():
    figures = step_figures(STAMPS)
    assert figures["skew_ms"] == pytest.approx(30 + 1)  # [0, 30] and [35, 36]
    assert figures["peer_wait_ms"] == pytest.approx(30) and figures["transfer_ms"] == pytest.approx(20)


def test_a_broadcast_root_that_finishes_first_transfers_nothing():
    # The root (rank 0) sends and completes before rank 1 enters: its time is all skew.
    stamps = [[(0.0, 0.002)], [(0.010, 0.011)]]
    (c,) = per_collective(stamps)
    assert c["transfer_ms"] == 0 and c["skew_ms"] == pytest.approx(10)


def test_unmatched_stamps_give_no_figures():
    assert not aligned([[(0, 1)], [(0, 1), (1, 2)]]) and step_figures([[(0, 1)], [(0, 1), (1, 2)]]) == {}
    assert not aligned([[(0, 1)]])  # one rank: nobody to wait for


def _step(blamed, last, compute, data=(1, 1, 1), step_ms=100.0):
    return {"blame": list(blamed), "last": list(last), "step_ms": step_ms,
            "phases": {"data": list(data), "compute": list(compute)}}


def test_the_verdict_names_the_rank_its_cost_and_a_compute_cause():
    steps = [_step([0, 0.5, 30], [0, 1, 9], [50, 51, 80]) for _ in range(6)]
    found = verdict(steps)
    assert found["rank"] == 2 and found["cost_ms"] == pytest.approx(30) and found["share"] == pytest.approx(0.3)
    assert found["cause"] == "compute" and found["excess_ms"]["compute"] == pytest.approx(29.5)
    assert found["last_share"] == pytest.approx(0.9) and found["held_share"] == 1
    assert found["chance"] == pytest.approx(3 / 3**6)  # some one of 3 ranks holding the others in 6 of 6 steps
    assert found["per_rank"]["last"] == [0, 6, 54] and found["per_rank"]["compute_ms"] == [50, 51, 80]
    assert found["per_rank"]["held"] == [0, 0, 6] and found["steps"] == 6


def test_the_chance_of_holding_the_others_in_so_many_steps():
    assert chance(6, 6, 4) == pytest.approx(4 / 4**6)
    assert chance(1, 6, 4) == 1  # a union bound, at most 1
    # 4 ranks, 17 steps (the default job's measured steps): 10 is chance at 1.2%, 11 at 0.25%
    assert chance(10, 17, 4) == pytest.approx(0.0124, abs=1e-4) and chance(11, 17, 4) == pytest.approx(0.0025, abs=1e-4)
    assert [steps_needed(ranks) for ranks in (2, 3, 4, 8)] == [8, 6, 5, 4]
    assert chance(5200, 10_000, 2) < 1e-4 and chance(5000, 10_000, 2) == 1  # a long job: no float overflow


def test_a_slow_draw_is_named_as_data():
    steps = [_step([20, 0, 0], [5, 0, 0], [50, 50, 50], data=(21, 1, 1)) for _ in range(6)]
    assert verdict(steps)["cause"] == "data"


def test_no_rank_stands_out_below_the_share_by_chance_or_in_too_few_steps():
    quiet = verdict([_step([0, 1, 1.5], [1, 1, 2], [50, 50, 50])] * 6)  # every step, but 1.5 ms of 100
    assert quiet["rank"] is None and quiet["why"] == "no rank stands out" and quiet["per_rank"]["held"] == [0, 0, 6]
    # A rank very late in 1 step and the others in turn: 3 of 6 steps is what chance gives, however long the one.
    turns = [_step([0, 0, 300], [0, 0, 2], [50, 50, 50])] + [_step([5, 0, 0], [2, 0, 0], [50, 50, 50])] * 2 + [
        _step([0, 5, 0], [0, 2, 0], [50, 50, 50])] + [_step([0, 0, 5], [0, 0, 2], [50, 50, 50])] * 2
    assert verdict(turns)["rank"] is None and verdict(turns)["per_rank"]["held"] == [2, 1, 3]
    few = verdict([_step([0, 0.5, 30], [0, 1, 9], [50, 51, 80])] * 5)
    assert few["rank"] is None and few["why"] == "5 measured steps cannot tell a straggler from chance (3 ranks need 6)"
    assert verdict([_step([0, 30, 30], [0, 5, 5], [50, 50, 50])] * 6)["rank"] is None  # a tie holds no one
    assert verdict([]) is None


def test_late_for_a_reason_the_stamps_do_not_show():
    steps = [_step([0, 30, 0], [0, 6, 0], [50, 52, 50])] * 6
    assert verdict(steps)["rank"] == 1 and verdict(steps)["cause"] is None


def test_the_other_detectors_rules():
    slow_compute = verdict([_step([0, 0, 30], [0, 1, 9], [50, 50, 80])])
    assert late_start_rule(slow_compute) == 2
    # traceml: the culprit has the shortest visible phase, the rank that waited least inside it. Where the
    # others wait after the phase (our strategies wait in finish_gradient_synchronization), the slow rank's
    # phase is the longest and nobody is named.
    assert traceml_rule(slow_compute) is None
    waits_inside_backward = verdict([_step([0, 0, 30], [0, 1, 9], [80, 80, 50])])  # torch DDP waits in backward()
    assert traceml_rule(waits_inside_backward) == 2
    assert traceml_rule(verdict([_step([0, 0, 3], [0, 1, 2], [50, 52, 55])])) is None  # under 10% of the step
    assert late_start_rule(verdict([_step([0, 0, 0], [2, 2, 0], [50, 50, 50])])) is None  # a tie names no one


# Backward ends at 100 ms and the sync at 140 ms on both ranks. Collective 0 completes inside backward; 1 is
# issued 5 ms before its end and takes 10 ms; 2 is issued after backward ended, once 1 is done.
WINDOWS = [(0.100, 0.140), (0.100, 0.140)]
ISSUED = [[(0.050, 0.060), (0.095, 0.110), (0.112, 0.125)]] * 2


def test_exposure_splits_the_wait_after_backward_among_the_collectives_and_says_why():
    rank, rows = exposure(ISSUED, WINDOWS)
    assert [r["exposed_ms"] for r in rows] == pytest.approx([0, 10, 13])  # 2's from its issue on
    assert [r["why"] for r in rows] == [None, ISSUED_LATE, ISSUED_AFTER]
    assert [r["issued_before_end_ms"] for r in rows] == pytest.approx([50, 5, -12])


def test_a_collective_held_by_the_one_before_it_is_queued():
    stamps = [[(0.090, 0.120), (0.092, 0.125)]] * 2  # 1 could have moved from 92 ms; the link was busy to 120
    _, rows = exposure(stamps, WINDOWS)
    assert [r["why"] for r in rows] == [ISSUED_LATE, QUEUED] and rows[1]["exposed_ms"] == pytest.approx(5)


def test_a_collective_held_by_a_late_rank_names_the_peer_on_the_rank_that_waited():
    stamps = [[(0.095, 0.130)], [(0.125, 0.130)]]  # rank 1 enters 30 ms late (its backward ended at 125 ms)
    rank, rows = exposure(stamps, [(0.100, 0.140), (0.125, 0.140)])
    assert rank == 0 and rows[0]["why"] == LATE_PEER and rows[0]["exposed_ms"] == pytest.approx(30)


def test_the_table_averages_each_collective_over_the_steps():
    steps = [exposure(ISSUED, WINDOWS)[1], exposure([[(0.050, 0.060), (0.095, 0.102), (0.112, 0.117)]] * 2,
                                                    WINDOWS)[1]]
    table = exposure_table(steps, [100, 200, 300])
    assert [c["bytes"] for c in table] == [100, 200, 300]
    assert [c["exposed_ms"] for c in table] == pytest.approx([0, (10 + 2) / 2, (13 + 5) / 2])
    assert [c["why"] for c in table] == [None, ISSUED_LATE, ISSUED_AFTER]


def test_the_tables_cells():
    from ddp_lab.analysis.records import injected_text, straggler_text

    found = verdict([_step([0, 0.5, 30], [0, 1, 9], [50, 51, 80]) for _ in range(6)])
    assert straggler_text(found) == "rank 2: 30.0 ms (30%), compute"
    assert straggler_text({"rank": None, "why": "no rank stands out"}) is None and straggler_text(None) is None
    assert injected_text({"kind": "slow", "rank": 1, "step": 2, "slowdown": 3.0}) == "slow 3x rank 1"
    assert injected_text({"kind": "hang", "rank": -1, "step": 1}) == "hang every rank"


def _measured(stamps, compute=(50, 50, 50), nodes=None, step_ms=100.0):
    """A step as rank/straggler.py records it, from stamps (the phases say nothing unless given)."""
    step = {**step_evidence(stamps), "step_ms": step_ms,
            "phases": {"data": [1] * len(stamps), "compute": list(compute)[: len(stamps)]}}
    if nodes:
        step |= {"nodes": nodes, "per_node": step_evidence(node_stamps(stamps, nodes))}
    return step


# 3 ranks, two blocking collectives (each rank enters the second 5 ms after the first completed on it).
# LINK: the first completes 20 ms later on rank 2 (the transfer into it ended late): it enters the second late.
# WORK: the first completes together; rank 2 works 25 ms before the second instead of 5.
LINK = [[(0.0, 0.010), (0.015, 0.040)], [(0.0, 0.010), (0.015, 0.040)], [(0.0, 0.030), (0.035, 0.040)]]
WORK = [[(0.0, 0.010), (0.015, 0.040)], [(0.0, 0.010), (0.015, 0.040)], [(0.0, 0.010), (0.035, 0.040)]]


def test_lateness_splits_into_the_link_into_the_rank_and_its_own_work():
    assert lateness(LINK)["link"] == pytest.approx([0, 0, 20]) and lateness(LINK)["work"][2] == pytest.approx(0)
    assert lateness(WORK)["work"] == pytest.approx([0, 0, 20]) and lateness(WORK)["link"][2] == pytest.approx(0)
    # Issued while the one before was in flight (overlap): that completion did not hold it, all work.
    overlapped = [[(0.0, 0.050), (0.015, 0.060)], [(0.0, 0.050), (0.015, 0.060)], [(0.0, 0.070), (0.035, 0.070)]]
    assert lateness(overlapped)["link"] == [0, 0, 0] and lateness(overlapped)["work"][2] == pytest.approx(20)


def test_a_lag_carried_in_is_the_path_into_the_rank_not_its_blame():
    found = verdict([_measured(LINK)] * 6)  # late only because the transfer into it ended late
    assert found["rank"] is None and found["per_rank"]["blame_ms"] == pytest.approx([0, 0, 0], abs=1e-9)
    assert found["per_rank"]["held"] == [0, 0, 0]
    assert found["per_rank"]["late_link_ms"][2] == pytest.approx(20)
    # Carried 10 ms in (its first collective completed 10 ms late on it), then worked 20 ms longer: 20 ms its own.
    mixed = [[(0.0, 0.010), (0.015, 0.050)], [(0.0, 0.010), (0.015, 0.050)], [(0.0, 0.020), (0.045, 0.050)]]
    assert blame(mixed) == pytest.approx([0, 0, 20])
    found = verdict([_measured(mixed)] * 6)
    assert found["rank"] == 2 and found["cost_ms"] == pytest.approx(20) and found["cause"] == "compute"
    assert found["per_rank"]["late_link_ms"][2] == pytest.approx(10)


def test_a_rank_whose_own_work_is_longer_is_compute_even_where_the_phases_hide_it():
    # fsdp: the others wait inside forward and backward (blocking all-gathers), so their compute phase is as
    # long as the slow rank's; its own work between collectives is what the stamps show.
    found = verdict([_measured(WORK, compute=(80, 80, 80))] * 6)
    assert found["rank"] == 2 and found["cause"] == "compute" and found["excess_ms"]["compute"] == 0


def test_a_slow_node_whose_ranks_share_the_lateness_is_named_when_no_rank_stands_out():
    # Ranks 2 and 3 (node 1) enter each of 4 collectives 30 ms after node 0's, taking turns at being last.
    stamps = [[(0.1 * k, 0.1 * k + 0.04) for k in range(4)]] * 2 + [
        [(0.1 * k + 0.030 + 0.001 * (k % 2 == r), 0.1 * k + 0.04) for k in range(4)] for r in (0, 1)]
    found = verdict([_measured(stamps, compute=(50,) * 4, nodes=[0, 0, 1, 1])] * 8)  # 2 nodes need 8 steps
    assert found["rank"] is None and found["node"] == 1
    assert found["cost_ms"] == pytest.approx(4 * 31) and found["per_rank"]["blame_ms"][2] == pytest.approx(2)
    assert found["cause"] == "compute"  # the node's own work: each collective before completed on time on it
    assert found["nodes"] == [0, 0, 1, 1] and found["per_node"]["last"] == [0, 32]
    assert found["per_rank"]["held"] == [0, 0, 0, 0]  # ranks 2 and 3 tie in every step
    # One rank of several nodes stands out: its node comes with it.
    assert verdict([_measured(WORK, nodes=[0, 0, 1])] * 6)["node"] == 1


def test_the_cells_of_a_node_verdict():
    from ddp_lab.analysis.records import straggler_text

    assert straggler_text({"rank": None, "node": 1, "cost_ms": 12.0, "share": 0.1, "cause": "link"}) == (
        "node 1: 12.0 ms (10%), link")
    assert straggler_text({"rank": 3, "node": 1, "cost_ms": 12.0, "share": 0.1, "cause": None}) == (
        "rank 3 (node 1): 12.0 ms (10%)")
    from ddp_lab.analysis.records import injected_text

    link = {"kind": "slow link", "node": 1, "gbps": 0.25, "step": 8, "made_in_step": 8}
    assert injected_text(None, link) == "node 1 link 0.25 Gbit/s from step 8"
    assert injected_text({"kind": "slow", "rank": 1, "step": 2, "slowdown": 1.3}, {**link, "made_in_step": 0}) == (
        "slow 1.3x rank 1; node 1 link 0.25 Gbit/s")


def test_a_lag_from_an_earlier_collective_is_still_the_link_behind_a_prefetch():
    # fsdp: rank 2's all-gather 0 completes 20 ms late (the link); it then issues the prefetch (1), which completes
    # with everyone's during its compute, and enters the reduce-scatter (2) 20 ms late after the same compute.
    stamps = [[(0.0, 0.010), (0.010, 0.020), (0.030, 0.040)], [(0.0, 0.010), (0.010, 0.020), (0.030, 0.040)],
              [(0.0, 0.030), (0.030, 0.035), (0.050, 0.055)]]
    assert lateness(stamps)["link"][2] == pytest.approx(20 + 20) and lateness(stamps)["work"][2] == pytest.approx(0)
