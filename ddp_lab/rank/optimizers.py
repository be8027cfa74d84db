"""`train.optimizer`: the optimizer every strategy's `make_optimizer` is handed (adamw, or muon).

`muon` is `MuonAdamW`: torch's own `torch.optim.Muon` on every 2-D parameter and torch's `AdamW` on
the rest (norms, biases), the split torch's Muon documentation shows and the MuLoCo paper (arXiv
2505.23725) trains with. Embedding and output matrices are 2-D, so Muon updates them too: that is the
documented split, written down here so no one mistakes it for the "hidden layers only" variant.
Muon reuses AdamW's learning rate and weight decay through `adjust_lr_fn="match_rms_adamw"` (torch's
option for Moonshot's rule: the update's RMS is matched to AdamW's, so `train.lr` means one thing for
both halves).

Why one optimizer and not two: a strategy takes one optimizer class (`make_optimizer(cls, params,
**kwargs)`), and sharding optimizers (zero1's, torch's ZeroRedundancyOptimizer) build theirs from a
class. `MuonAdamW` is a `torch.optim.Optimizer` whose `step` hands the 2-D parameters of each of its
param groups, and its `state`, to a `torch.optim.Muon` and the rest to a `torch.optim.AdamW`: the update
arithmetic is torch's, never written again here. Muon orthogonalizes a whole matrix, so a
strategy whose optimizer sees a flat slice of a parameter (zero2, fsdp, hsdp, fsdp_torch, DeepSpeed)
cannot run it: their specs say `whole_parameter_optimizer = False` and the launcher refuses the pair.
"""

from __future__ import annotations

import torch

from ddp_lab.config import OptimizerName


class MuonAdamW(torch.optim.Optimizer):
    """torch's Muon on 2-D parameters, torch's AdamW on the rest, as one optimizer (module docstring).

    Its param groups are the ones it is given (a sharding optimizer, torch's ZeroRedundancyOptimizer, matches
    them one to one); at each step every group is split by dimension for the two inner optimizers."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.01):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        placeholder = [torch.zeros(1, 1, requires_grad=True)]  # the inner optimizers' defaults; groups come per step
        self._inner = {"muon": torch.optim.Muon(placeholder, lr=lr, weight_decay=weight_decay,
                                                adjust_lr_fn="match_rms_adamw"),
                       "adamw": torch.optim.AdamW(placeholder, lr=lr, weight_decay=weight_decay)}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for name, inner in self._inner.items():
            # our groups as they are now (after a load_state_dict, a scheduler's change), this optimizer's
            # parameters of each, with the inner optimizer's defaults (betas, momentum) where a group sets none
            inner.param_groups = [{**inner.defaults, **group, "params": mine} for group in self.param_groups
                                  if (mine := [p for p in group["params"] if (p.ndim == 2) == (name == "muon")])]
            inner.state = self.state  # one state, keyed by parameter, for both
            inner.step()
        return loss


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The class `train.optimizer=NAME` hands a strategy's `make_optimizer`."""
    if name == "adamw":
        return torch.optim.AdamW
    if name == "muon":
        return MuonAdamW
    raise ValueError(f"train.optimizer must be one of {', '.join(o.value for o in OptimizerName)}, got {name!r}")
