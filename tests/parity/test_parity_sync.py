"""NaiveDDP and FlatDDP train to the single-process weights (see ddp_lab/check/parity.py)."""

import pytest

from ddp_lab.check.parity import assert_parity, train_distributed
from ddp_lab.check.ranks import run_ranks
from ddp_lab.strategies import FlatDDP, NaiveDDP


def _all_models(rank, world_size, wrapper_cls, grad_accum_steps):
    return {name: train_distributed(rank, world_size, wrapper_cls, name, grad_accum_steps=grad_accum_steps)
            for name in ("frozen", "tied", "transformer")}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("wrapper_cls", [NaiveDDP, FlatDDP], ids=["naive", "flat"])
def test_matches_single_process(wrapper_cls, world_size):
    results = run_ranks(_all_models, world_size, wrapper_cls, 1)
    for name in ("frozen", "tied", "transformer"):
        assert_parity([r[name] for r in results])


@pytest.mark.parametrize("wrapper_cls", [NaiveDDP, FlatDDP], ids=["naive", "flat"])
def test_grad_accumulation_matches_single_process(wrapper_cls):
    results = run_ranks(_all_models, 2, wrapper_cls, 2)
    for name in ("frozen", "tied", "transformer"):
        assert_parity([r[name] for r in results])


def _divergent(rank, world_size, wrapper_cls):
    """Without the wrapper's synchronization, ranks with different init/data must disagree."""
    import torch

    from ddp_lab.check.models import MODELS
    from ddp_lab.check.parity import global_batch, loss_of
    torch.manual_seed(rank)
    model = MODELS["tied"]()
    ddp = wrapper_cls(model)
    loss_of(ddp, global_batch(0)[rank::world_size]).backward()   # no finish_gradient_synchronization
    return ddp.module.embed.weight.grad.clone()


def test_parity_check_can_fail():
    """Guards the guard: skipping the synchronization leaves different gradients per rank."""
    import torch
    grads = run_ranks(_divergent, 2, FlatDDP)
    assert not torch.allclose(grads[0], grads[1])
