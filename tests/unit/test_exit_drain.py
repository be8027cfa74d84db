"""The exit drain (strategies/exit_drain.py): an async collective registers it once, and at exit it waits
for what is still in flight, then gives completing threads time to let go of Python before finalization.
Whether that keeps a course's harness from aborting is measured, not asserted here:
benchmarks/teardown_cs336.py, docs/benchmarks.md."""

import threading
import time

import torch

from ddp_lab.strategies import exit_drain


def test_a_tracked_collective_is_waited_for_at_exit(monkeypatch):
    registered = []
    monkeypatch.setattr(exit_drain, "_registered", False)
    monkeypatch.setattr(exit_drain.atexit, "register", registered.append)
    pending = torch.futures.Future()
    exit_drain.track(pending)
    exit_drain.track(torch.futures.Future())
    assert registered == [exit_drain.drain]  # once, however many collectives

    threading.Timer(0.2, pending.set_result, args=(None,)).start()  # completes while the exit waits
    start = time.monotonic()
    exit_drain.drain()
    assert pending.done() and time.monotonic() - start >= 0.2 + exit_drain.SETTLE_S * 0.9
