"""The harness every parity test runs its ranks in (ddp_lab/check/ranks.py): a rank that dies of a native fault says
where it was."""

import os
import resource

import pytest
from torch.multiprocessing import ProcessExitedException

from ddp_lab.check.ranks import run_ranks


def _abort_on_rank_1(rank, world_size):
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file left behind
        os.abort()  # what glibc does on a corrupted heap ("malloc(): unaligned tcache chunk detected")
    return rank


def test_a_rank_killed_by_a_native_abort_leaves_every_threads_python_stack(tmp_path):
    with pytest.raises(ProcessExitedException, match="SIGABRT"):
        run_ranks(_abort_on_rank_1, 2, log_dir=str(tmp_path))
    log = (tmp_path / "rank1.log").read_text()
    assert "Fatal Python error: Aborted" in log and "_abort_on_rank_1" in log
