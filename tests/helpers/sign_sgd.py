"""The reference strategy=demo is held against where it keeps every coefficient (strategies/demo.py)."""

import torch


class SignSGD(torch.optim.Optimizer):
    """θ ← θ(1 - lr·wd) - lr·sign(g), rounded as torch's SGD with weight_decay rounds it: θ - lr (sign(g) + wd θ)."""

    def __init__(self, params, lr, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign().add(p, alpha=group["weight_decay"]), alpha=-group["lr"])
