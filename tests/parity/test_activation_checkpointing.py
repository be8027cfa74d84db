"""`train.activation_checkpointing`: recomputation changes what is kept, never what is trained. Under every
data-parallel strategy, at 2 ranks, full and selective checkpointing train to the same weights as the same strategy
without it, bit for bit (the same operations replayed on the same inputs); the strategy without it is proven against
one process elsewhere. And the census of saved activations sees full checkpointing keep less."""

from contextlib import nullcontext

import pytest
import torch

from ddp_lab.check.models import tiny_transformer
from ddp_lab.rank.activations import HeldActivations
from ddp_lab.rank.recompute import apply_activation_checkpointing
from ddp_lab.rank.step import train_step
from ddp_lab.spec.strategies import spec_of
from tests.helpers.distributed import rank_batch, ranks_fixture

STRATEGIES = ["none", "flat", "overlap", "bucketed", "torch_ddp", "zero1", "zero1_torch", "zero2", "fsdp",
              "fsdp_torch", "powersgd", "local_sgd"]
STEPS = 3


def _train(name: str, mode: str, rank: int, world_size: int) -> dict:
    torch.manual_seed(rank)  # a different init per rank: the strategy's broadcast fixes it
    module = tiny_transformer()
    apply_activation_checkpointing(module, mode)
    model = spec_of({"name": name}).build(module)
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=1e-2)
    held = HeldActivations()
    for step in range(STEPS):
        with held.counting() if step == 0 else nullcontext():
            train_step(model, optimizer, [rank_batch(step, rank, world_size)])
    return {"weights": {k: v.clone() for k, v in model.full_state_dict().items()}, "held": held.peak}


def _every(rank: int, world_size: int) -> dict:
    return {(name, mode): _train(name, mode, rank, world_size) for name in STRATEGIES
            for mode in ("none", "full", "selective")}


results = ranks_fixture(_every, 2)


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("name", STRATEGIES)
def test_checkpointing_trains_the_same_weights_bit_for_bit(results, name, mode):
    for rank in results:
        plain, recomputed = rank[(name, "none")]["weights"], rank[(name, mode)]["weights"]
        assert plain.keys() == recomputed.keys()
        for key in plain:
            assert torch.equal(plain[key], recomputed[key]), (name, mode, key)


def test_full_checkpointing_keeps_less(results):
    """The census (saved-tensor hooks) sees each block keep only its input under full checkpointing. It does not see
    what selective keeps: torch's selective contexts hold the matmuls' outputs outside those hooks."""
    held = results[0]
    assert held[("bucketed", "full")]["held"] < held[("bucketed", "none")]["held"] / 2
