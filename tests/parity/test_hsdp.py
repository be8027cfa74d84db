"""hsdp: fsdp inside shard groups, replicated across them, trains to the single-process weights.

At 4 ranks as 2 groups of 2 (frozen, tied and Transformer models; two micro-batches with the first
under no_sync) and at 6 ranks as 3 groups of 2 and 2 groups of 3, every rank ends with the weights
single-process training on the whole batch reaches (to float32 rounding; check/parity.py). torch's own
hybrid sharding, FSDP2 on a 2-D (replicate x shard) mesh (`fsdp_torch` with `shard_size`), ends on
the same weights. Each rank holds 1/shard_size of every sharded parameter (not 1/world_size), and the
shard groups are consecutive ranks (a node's, as torchrun numbers them), the replica groups the ranks
at the same place in each.
"""

from functools import partial

import pytest
import torch

from ddp_lab.check.parity import assert_parity, train_distributed
from ddp_lab.check.ranks import run_ranks
from ddp_lab.strategies import HSDP, TorchFSDP
from ddp_lab.strategies.hsdp import shard_layout
from tests.helpers.distributed import ranks_fixture


def _local_numel(wrapper, optimizer):
    """Every sharded parameter's local rows, and its whole shape (to hold against 1/shard_size)."""
    return {e.name: (e.local.shape[0], e.rows) for unit in wrapper.units for e in unit.sharded}


def _run(rank, world_size, shard_size, models):
    batch = 2 * world_size
    hsdp = partial(HSDP, shard_size=shard_size)
    out = {name: train_distributed(rank, world_size, hsdp, name, batch_size=batch, inspect=_local_numel)
           for name in models}
    if world_size == 4:
        out["accumulate"] = train_distributed(rank, world_size, hsdp, "transformer", batch_size=batch,
                                              grad_accum_steps=2, set_to_none=False)
        out["torch"] = train_distributed(rank, world_size, partial(TorchFSDP, shard_size=shard_size), "transformer",
                                         batch_size=batch)
    return out


four = ranks_fixture(_run, 4, 2, ("frozen", "tied", "transformer"))


@pytest.mark.parametrize("name", ["frozen", "tied", "transformer", "accumulate", "torch"])
def test_2x2_same_weights_as_single_process(four, name):
    assert_parity([r[name][:2] for r in four])


def test_torchs_hybrid_sharding_ends_on_the_same_weights(four):
    ours, torchs = four[0]["transformer"][0], four[0]["torch"][0]
    for key, tensor in ours.items():
        torch.testing.assert_close(torchs[key], tensor, atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


def test_each_rank_holds_its_shard_groups_share(four):
    for rank, result in enumerate(four):
        for name, (local_rows, rows) in result["transformer"][2].items():
            chunk = -(-rows // 2)  # padded rows per rank of a group of 2, not of 4
            assert local_rows == max(0, min(chunk, rows - (rank % 2) * chunk)), (rank, name)


@pytest.mark.parametrize("shard_size", [2, 3], ids=["3x2", "2x3"])
def test_six_ranks(shard_size):
    results = run_ranks(_run, 6, shard_size, ("tied", "transformer"))
    for name in ("tied", "transformer"):
        assert_parity([r[name][:2] for r in results])


def test_shard_groups_are_a_nodes_ranks():
    assert shard_layout(6, 3) == ([[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]])
    assert shard_layout(4, 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
