"""At interpreter exit, let the threads that complete collectives finish with Python before it is torn down.

Why: a collective's completion runs Python on the thread that completes it (gloo's worker threads, or
the lab's ring worker): the callback that stamps its end, and, after the waiting rank has already been
woken, the release of that callback and of the Python objects it held, which needs the GIL again. A
rank whose script ends right after its last wait (a course's test harness: synchronize, step, compare,
`destroy_process_group()`, return) can reach interpreter finalization inside that window; the
completing thread then asks for the GIL of a finalizing interpreter, is ended by `pthread_exit`, whose
forced unwind crosses a `noexcept` frame, and the rank aborts (SIGABRT, `terminate called without an
active exception`) after everything passed. benchmarks/teardown_cs336.py measured it: 2 of 200 runs of
the course's OverlapDDP test (docs/benchmarks.md, "Ranks that abort at exit").

What this does: the first async collective a process launches registers `drain` with `atexit`, which
runs while the interpreter is still whole. It waits for every collective still in flight, then releases
the GIL for `SETTLE_S`, so a completing thread that was woken but not yet scheduled takes the GIL and
lets go of what it holds while that is still allowed. Ranks started by ddp-lab end with `os._exit`
and never run it; a user's own harness does.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref

SETTLE_S = 0.1
"""How long the exit waits, GIL released, for completing threads to finish their Python (their work is
microseconds; the time is for a thread descheduled on a busy machine to be scheduled again)."""

_in_flight: weakref.WeakSet = weakref.WeakSet()
_registered = False
_lock = threading.Lock()


def track(future) -> None:
    """Remember an async collective's future until it is collected; register the exit drain once."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(drain)
            _registered = True
    try:
        _in_flight.add(future)
    except TypeError:  # an object that cannot be weakly referenced: waited for by its owner
        pass


WAIT_S = 10.0
"""At most this long for collectives still in flight at exit (one whose peer is gone would never end)."""


def drain() -> None:
    """Wait (at most `WAIT_S`) for the collectives still in flight, then give completing threads
    `SETTLE_S` to let go."""
    deadline = time.monotonic() + WAIT_S
    for future in list(_in_flight):
        while not future.done() and time.monotonic() < deadline:
            time.sleep(0.01)
    time.sleep(SETTLE_S)
