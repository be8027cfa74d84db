"""Standing in for torch.distributed's communication calls while a check watches them: the pipeline check's stages
(pipeline.py `Watch`) and the context-parallel check's ranks (context.py `Waits`) both see every call, note the one
they are blocked in (so that a hang can be told) and time or count them.

A call is replaced in torch.distributed and in torch.distributed.distributed_c10d by one and the same object:
`P2POp` checks its op against c10d's own isend and irecv by identity, and `batch_isend_irecv` calls each op's
function (one by one on gloo), so a stand-in in one home only breaks code that builds P2POps. c10d's blocking send and
recv run its isend and irecv inside: while a stand-in's call runs, the calls it makes go straight through (the same
call, watched once).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist


class WatchedWork:
    """A request (isend, irecv, an async collective) whose wait is timed and watched by `watch.blocked`."""

    def __init__(self, work, watch, what: str):
        self._work, self._watch, self._what = work, watch, what

    def wait(self, *args, **kwargs):
        with self._watch.blocked(self._what):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


PEER_KEYWORDS = ("dst", "src", "group_dst", "group_src", "group_peer")
POINT_TO_POINT = ("send", "recv", "isend", "irecv")


def peer_of(name: str, args: tuple, kwargs: dict):
    """The peer of a point-to-point call, however given (a rank, or a group rank; by keyword or position); None for
    a collective."""
    for key in PEER_KEYWORDS:
        if kwargs.get(key) is not None:
            return kwargs[key]
    return args[1] if name in POINT_TO_POINT and len(args) > 1 else None


@contextmanager
def standing_in(names: tuple[str, ...], make):
    """Each of `names` replaced in both homes by `make(name, original)` (module docstring), the originals put back
    after; a call made while a stand-in runs goes straight to the original."""
    from torch.distributed import distributed_c10d as c10d

    running = []

    def guarded(name):
        original = getattr(c10d, name, None) or getattr(dist, name)
        stand_in = make(name, original)

        def call(*args, **kwargs):
            if running:
                return original(*args, **kwargs)
            running.append(name)
            try:
                return stand_in(*args, **kwargs)
            finally:
                running.pop()
        return call

    originals = {(home, n): getattr(home, n) for home in (dist, c10d) for n in names if hasattr(home, n)}
    wrapped = {name: guarded(name) for name in names}
    for home, name in originals:
        setattr(home, name, wrapped[name])
    try:
        yield
    finally:
        for (home, name), fn in originals.items():
            setattr(home, name, fn)
