"""rank/optimizers.py: `MuonAdamW` is torch's Muon on the 2-D parameters and torch's AdamW on the rest, to the
bit, through a save and load of its state_dict; `optimizer_class` maps train.optimizer."""

import pytest
import torch

from ddp_lab.check.models import MODELS
from ddp_lab.rank.optimizers import MuonAdamW, optimizer_class


def _grads(model, step):
    torch.manual_seed(100 + step)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)


def test_muon_adamw_is_torchs_muon_and_adamw_to_the_bit():
    torch.manual_seed(0)
    ours, theirs = MODELS["transformer"](), MODELS["transformer"]()
    theirs.load_state_dict(ours.state_dict())
    combined = MuonAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    matrices = [p for p in theirs.parameters() if p.ndim == 2]
    rest = [p for p in theirs.parameters() if p.ndim != 2]
    assert matrices and rest
    muon = torch.optim.Muon(matrices, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1)
    for step in range(4):
        if step == 2:  # a state_dict round trip in the middle: the inner optimizers follow the new groups
            state = combined.state_dict()
            combined = MuonAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
            combined.load_state_dict(state)
        _grads(ours, step)
        _grads(theirs, step)
        combined.step()
        muon.step()
        adamw.step()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name
    assert {"momentum_buffer"} == set(combined.state[next(p for p in ours.parameters() if p.ndim == 2)])


def test_muon_is_not_adamw():
    torch.manual_seed(0)
    a, b = MODELS["transformer"](), MODELS["transformer"]()
    b.load_state_dict(a.state_dict())
    _grads(a, 0)
    _grads(b, 0)
    MuonAdamW(a.parameters(), lr=1e-2).step()
    torch.optim.AdamW(b.parameters(), lr=1e-2).step()
    assert any(not torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()) if x.ndim == 2)


def test_optimizer_class_maps_the_config_and_refuses_others():
    assert optimizer_class("adamw") is torch.optim.AdamW
    assert optimizer_class("muon") is MuonAdamW
    with pytest.raises(ValueError, match="train.optimizer must be one of adamw, muon"):
        optimizer_class("sgd")
