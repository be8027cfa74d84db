"""What a layer does once a forward beyond its output is not done again by a checkpointed block's recompute
(rank/recompute.py's `recomputing`): a mixture's load, which its bias balancing moves against, is counted once, and
the balancing loss's term the loss took is not set again for the next loss to take. Each runs with torch's early stop
off (the recompute runs the whole block, as it does wherever backward needs the block's last tensors) and with it
on (the default)."""

import pytest
import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

from ddp_lab.models.moe import moe_layers
from ddp_lab.rank.recompute import apply_activation_checkpointing
from tests.helpers.moe import tiny_moe

ROWS = (4, 8)


def _after_backward(balance: str, mode: str, early_stop: bool):
    torch.manual_seed(0)
    model = tiny_moe(balance=balance)()
    apply_activation_checkpointing(model, mode)
    tokens = torch.randint(0, model.lm_head.out_features, ROWS)
    layers = moe_layers(model)
    with set_checkpoint_early_stop(early_stop):
        loss = model(tokens).float().mean()
        terms = [layer.pop_aux() for layer in layers]  # as the job's loss takes them (models/moe.py's BalancedLoss)
        if balance == "aux_loss":
            loss = loss + torch.stack(terms).sum()
        loss.backward()
    return layers, terms


@pytest.mark.parametrize("early_stop", [False, True])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_bias_balancings_load_is_counted_once(mode, early_stop):
    plain, _ = _after_backward("bias", "none", early_stop)
    recomputed, _ = _after_backward("bias", mode, early_stop)
    for a, b in zip(plain, recomputed, strict=True):
        assert a.step_load.sum() > 0
        assert torch.equal(a.step_load, b.step_load)


@pytest.mark.parametrize("early_stop", [False, True])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_recompute_leaves_the_next_loss_no_term(mode, early_stop):
    layers, terms = _after_backward("aux_loss", mode, early_stop)
    assert all(t is not None for t in terms)
    assert all(layer.aux is None for layer in layers)
