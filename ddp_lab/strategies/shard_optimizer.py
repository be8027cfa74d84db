"""`ShardOptimizerBase`: what ZeRO-1's and ZeRO-2's optimizers share.

Both are a `torch.optim.Optimizer` whose `param_groups` list every parameter the user gave, with
the inner optimizer's full hyperparameters (so LR schedulers and users edit them as usual), while
an inner `optimizer_cls` (`self.optim`) holds state for and updates only this rank's share. What a
share is differs, and is all a subclass says:

- `_local_group(group)`: the inner group's tensors for a new outer group (zero1: the parameters
  this rank owns, whole; zero2: this rank's flat slice of each parameter);
- `_before_update()`: communication the update needs first (zero1's reduce-scatter, when the
  wrapper has not done it);
- `_share_updates()`: how the updated values reach every rank (broadcasts or all-gathers).

Waits inside `step()` are exposed communication, recorded as the optimizer's share
(`CommStats.exposed(in_optimizer=True)`) in `comm_stats` when one is given.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Iterable

import torch


class ShardOptimizerBase(torch.optim.Optimizer):
    def __init__(self, params: Iterable, optimizer_cls: type[torch.optim.Optimizer], *, comm_stats=None,
                 **kwargs: Any):
        self.comm_stats = comm_stats
        self.optim: torch.optim.Optimizer | None = None
        self._optimizer_cls, self._kwargs = optimizer_cls, kwargs
        # The inner optimizer's full defaults (betas, eps, ...) so outer groups carry every
        # hyperparameter a scheduler or a state_dict reader may look for.
        try:
            defaults = optimizer_cls([torch.zeros(1, requires_grad=True)], **kwargs).defaults
        except Exception:  # e.g. fused=True wants CUDA tensors; the real build below will say if it is wrong
            defaults = dict(kwargs)
        super().__init__(params, defaults)

    # `state` is the inner optimizer's (this rank's share); the base constructor assigns it first.
    @property
    def state(self):
        return self.optim.state if self.optim is not None else self._early_state

    @state.setter
    def state(self, value):
        if self.optim is None:
            self._early_state = value
        else:
            self.optim.state = value

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (in the constructor or mid-training); its local share goes to the inner optimizer."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        local = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        local.update(self._local_group(group))
        if self.optim is None:
            self.optim = self._optimizer_cls([local], **self._kwargs)
            self.optim.state.update(self._early_state)
        else:
            self.optim.add_param_group(local)

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        self._before_update()
        self.optim.step(**kwargs)
        with self._exposed():
            self._share_updates()
        return loss

    def _sync_hyperparameters(self) -> None:
        """Outer groups are what users and schedulers edit; the inner optimizer follows them."""
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            for key, value in outer.items():
                if key not in ("params", "param_names"):
                    inner[key] = value

    def _exposed(self):
        return self.comm_stats.exposed(in_optimizer=True) if self.comm_stats is not None else nullcontext()

    def _timed(self, nbytes: int, calls: int = 1):
        """One interval for `calls` collectives launched together (they are in flight together)."""
        return self.comm_stats.timed(nbytes, calls) if self.comm_stats is not None else nullcontext()

    # What a subclass decides (module docstring).
    def _local_group(self, group: dict) -> dict:
        """{"params": [...]} (and "param_names" when the group has names) for the inner optimizer."""
        raise NotImplementedError

    def _before_update(self) -> None:
        pass

    def _share_updates(self) -> None:
        raise NotImplementedError
