"""Ranks for the tests: `ranks_fixture`, one set of rank processes shared by a test file
(`ddp_lab.check.ranks.run_ranks` starts them)."""

from __future__ import annotations

import pytest

from ddp_lab.check.ranks import run_ranks


def ranks_fixture(fn, world_size: int, *args):
    """A module-scoped fixture holding `run_ranks(fn, world_size, *args)`: one set of rank processes
    (the slow part) for every test of a file that reads it."""

    @pytest.fixture(scope="module")
    def results():
        return run_ranks(fn, world_size, *args)

    return results


def rank_batch(step: int, rank: int, world_size: int):
    """(inputs, targets) of this rank's rows of step `step`'s global batch (check/parity.py's `global_batch`)."""
    from ddp_lab.check.parity import global_batch

    tokens = global_batch(step)
    rows = tokens.shape[0] // world_size
    mine = tokens[rank * rows:(rank + 1) * rows]
    return mine[:, :-1], mine[:, 1:]
