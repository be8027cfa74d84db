"""CommStats: a step's comm figures are the union of in-flight intervals, counts and bytes, and exposed time."""

import time

import pytest
import torch

from ddp_lab.strategies import comm_stats
from ddp_lab.strategies.comm_stats import CommStats, Stamp, record_intervals

CPU = torch.device("cpu")


def test_overlapping_collectives_count_once_and_pop_resets():
    comm = CommStats(CPU)
    comm.add(0.0, 1.0, 100)
    comm.add(0.5, 1.5, 50)    # overlaps the first: the union is 1.5 s, not 2 s
    comm.add(3.0, 3.25, 10)   # apart: +0.25 s
    figures = comm.pop()
    assert figures["comm_ms"] == pytest.approx(1750.0)
    assert (figures["collectives"], figures["comm_bytes"]) == (3, 160)
    assert comm.pop() == {"comm_ms": 0.0, "exposed_comm_ms": 0.0, "exposed_optimizer_comm_ms": 0.0,
                          "compress_ms": 0.0, "collectives": 0, "comm_bytes": 0}


def test_timed_counts_calls_launched_together_as_one_interval():
    comm = CommStats(CPU)
    with comm.timed(nbytes=64, calls=5):
        time.sleep(0.01)
    figures = comm.pop()
    assert figures["collectives"] == 5 and figures["comm_bytes"] == 64
    assert figures["comm_ms"] >= 10.0


def test_exposed_time_and_the_optimizers_share_of_it():
    comm = CommStats(CPU)
    with comm.exposed():
        time.sleep(0.02)
    with comm.exposed(in_optimizer=True):
        time.sleep(0.01)
    figures = comm.pop()
    assert figures["exposed_comm_ms"] >= 30.0
    assert 10.0 <= figures["exposed_optimizer_comm_ms"] < figures["exposed_comm_ms"]


def test_host_stamps_become_intervals():
    comm = CommStats(CPU)
    stamps = [Stamp(8), Stamp(8)]
    (stamps[0].start, stamps[0].end), (stamps[1].start, stamps[1].end) = (1.0, 2.0), (1.5, 2.5)
    record_intervals(stamps, comm)
    assert comm.pop()["comm_ms"] == pytest.approx(1500.0)


def test_arithmetic_is_compute_and_a_wait_in_backward_is_exposed(monkeypatch):
    """PowerSGD's case: a wait for a collective inside backward counts as exposed comm (once, also when
    inside finish_gradient_synchronization's exposed window); compression arithmetic is compress_ms
    and never exposed, even inside that window."""
    clock = iter([0.0, 1.0,          # waited() in backward: 1 s exposed
                  1.0, 1.5,          # arithmetic() in backward: 0.5 s compress
                  2.0,               # exposed() starts
                  2.0, 2.25,         # arithmetic() inside it: 0.25 s
                  2.5, 3.0,          # waited() inside it: already counted by exposed()
                  4.0])              # exposed() ends: 2 s, less 0.25 s arithmetic
    monkeypatch.setattr(comm_stats.time, "perf_counter", lambda: next(clock))
    comm = CommStats(torch.device("cpu"))
    with comm.waited():
        pass
    with comm.arithmetic():
        pass
    with comm.exposed():
        with comm.arithmetic():
            pass
        with comm.waited():
            pass
    figures = comm.pop()
    assert figures["exposed_comm_ms"] == pytest.approx(1000.0 + 1750.0)
    assert figures["compress_ms"] == pytest.approx(750.0)


def test_a_carried_collective_counts_in_every_step_it_is_in_flight(monkeypatch):
    """local SGD's delayed sync: launched at 1.0 in step A (its figures taken at 2.0), in flight through
    step B (taken at 5.0), ended at 4.0: A has [1, 2] and its bytes, B has [2, 4] and no bytes, C nothing."""
    clock = iter([2.0, 5.0, 7.0])
    monkeypatch.setattr(comm_stats.time, "perf_counter", lambda: next(clock))
    comm = CommStats(torch.device("cpu"))
    stamp = comm_stats.Stamp(1000)
    stamp.start = 1.0
    comm.carry(stamp)
    a = comm.pop()
    stamp.end = 4.0
    b = comm.pop()
    c = comm.pop()
    assert (a["comm_ms"], a["comm_bytes"], a["collectives"]) == (pytest.approx(1000.0), 1000, 1)
    assert (b["comm_ms"], b["comm_bytes"], b["collectives"]) == (pytest.approx(2000.0), 0, 0)
    assert (c["comm_ms"], c["comm_bytes"], c["collectives"]) == (0.0, 0, 0)
