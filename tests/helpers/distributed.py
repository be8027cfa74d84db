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
