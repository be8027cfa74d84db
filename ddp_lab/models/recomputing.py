"""Whether a forward is a checkpointed block's recompute in backward (rank/recompute.py checkpoints the blocks): for
a layer that does something once a forward beyond its output, which the recompute must not do again (a mixture's
load for its balancing, models/moe.py). Here, beside the models, as the launcher builds them too."""

from __future__ import annotations

from itertools import count

_RECOMPUTING: list[bool] = []


def recomputing() -> bool:
    """Whether the forward running now is a checkpointed block's recompute in backward, for a layer that does
    something once a forward beyond its output (`ONCE_A_FORWARD`: a mixture's load for its balancing)."""
    return bool(_RECOMPUTING) and _RECOMPUTING[-1]


ONCE_A_FORWARD = "once_a_forward"
"""A module's attribute, True where its forward does something that must not happen again in a recompute: its
block's forward is then told apart from the recompute (`recomputing()`). Only there: telling them apart mutates state
outside the checkpointed region, which Dynamo cannot trace inside checkpoint's higher-order op (the block would run
eager under train.compile)."""


def told_apart(forward):
    """`forward` whose first call is the forward and any later one the recompute, as `recomputing()` says."""
    calls = count()

    def run(*args, **kwargs):
        _RECOMPUTING.append(next(calls) > 0)
        try:
            return forward(*args, **kwargs)
        finally:
            _RECOMPUTING.pop()
    return run
