"""The floor (`strategy=none`): at one rank it is single-process training, bit for bit; at more ranks each rank
trains alone, so their weights part (what its facts say), and it takes no checkpoint."""

import pytest
import torch

from ddp_lab.check.parity import assert_parity, train_distributed
from ddp_lab.check.ranks import run_ranks
from ddp_lab.spec.strategies import spec_of
from ddp_lab.strategies import NoSync


def _train(rank, world_size):
    return {name: train_distributed(rank, world_size, NoSync, name, exact_reference=True)
            for name in ("frozen", "tied", "transformer")}


def test_at_one_rank_the_floor_is_single_process_training():
    results = run_ranks(_train, 1)
    for name in ("frozen", "tied", "transformer"):
        assert_parity([r[name] for r in results], exact=True)


def _facts_and_weights(rank, world_size):
    torch.manual_seed(rank)
    state, _ = train_distributed(rank, world_size, NoSync, "transformer")
    return NoSync(torch.nn.Linear(2, 2)).facts(), state


def test_at_two_ranks_each_rank_trains_alone_and_says_so():
    (facts, first), (_, second) = run_ranks(_facts_and_weights, 2)
    assert facts["floor"]["synchronizes"] is False and "trains alone" in facts["floor"]["ranks"]
    assert any(not torch.equal(first[k], second[k]) for k in first), "the ranks' weights should part"


def test_the_floor_refuses_checkpoints():
    with pytest.raises(ValueError, match="no checkpoints"):
        spec_of({"name": "none"}).check_checkpoints()
