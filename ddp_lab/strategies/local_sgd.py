"""`strategy=local_sgd`: no gradient communication; parameters averaged every `sync_every` steps.

Each rank steps its own optimizer on its own gradients (`finish_gradient_synchronization()` does
nothing), so between synchronizations the ranks' models drift apart. After every `sync_every`-th
`optimizer.step()` the trainable parameters and the persistent floating-point buffers (running
statistics) are averaged over ranks with one all-reduce, and every rank continues from the
average: parameter averaging, the alternative to gradient averaging (local SGD, Stich 2019;
Lin et al. 2020). With `sync_every=1` and plain SGD this *is* data parallelism: the mean of
θ - lr g_k is θ - lr mean(g_k). Each rank keeps its own optimizer state (Adam's moments are not
averaged, as in DiLoCo's inner optimizer).

`outer=nesterov` (DiLoCo, Douillard et al. 2023): the averaged change is treated as a gradient
for an outer optimizer instead of being taken as is. With θ the parameters at the last
synchronization and θ̄ the rank average now, the pseudo-gradient Δ = θ - θ̄ feeds SGD with
Nesterov momentum (torch's `SGD(nesterov=True)`: b = μ b + Δ, θ ← θ - lr (Δ + μ b)), with
DiLoCo's values lr 0.7 and momentum 0.9 (`OUTER_LR`, `OUTER_MOMENTUM`). `outer=none` is plain
averaging (outer lr 1, no momentum). Buffers are always plainly averaged. The outer state
(θ at the last sync and the momentum b, two copies of the trainable parameters) lives in the
wrapper, not in the optimizer's state.

How it fits the strategy contract without the trainer knowing: `make_optimizer` returns the plain
optimizer with a step post-hook (`register_step_post_hook`) that counts steps and averages. The
averaging all-reduce is exposed communication inside the optimizer step (as zero1's broadcasts
are): `comm_bytes` is the whole model's bytes on sync steps and 0 on the others, so a run's mean
per step is 1/sync_every of a gradient all-reduce's.

Bad input: `sync_every` < 1 and an unknown `outer` are refused (its spec, before launch, and
here). There is no gradient collective, so `strategy.comm_dtype` means nothing here
(its spec: `reduces_gradients = False`).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddp_lab.strategies.base import DataParallelBase
from ddp_lab.strategies.collectives import all_reduce_mean_
from ddp_lab.units import tensor_bytes

OUTER_LR = 0.7        # DiLoCo's outer learning rate (Douillard et al. 2023, section 3)
OUTER_MOMENTUM = 0.9  # DiLoCo's Nesterov momentum
OUTERS = ("none", "nesterov")


def averaged_buffers(module: nn.Module) -> list[torch.Tensor]:
    """Persistent floating-point buffers (running statistics), each once. Non-persistent ones (a
    RoPE table) are computed, identical on every rank, and not sent."""
    seen, out = set(), []
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if (buffer is not None and buffer.is_floating_point() and name not in sub._non_persistent_buffers_set
                    and id(buffer) not in seen):
                seen.add(id(buffer))
                out.append(buffer)
    return out


class LocalSGD(DataParallelBase):
    """Local SGD behind the strategy contract (module docstring): `LocalSGD(module, sync_every=4, outer="none")`."""

    def __init__(self, module: nn.Module, sync_every: int = 4, outer: str = "none"):
        if not (isinstance(sync_every, int) and sync_every >= 1):
            raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")
        if str(outer) not in OUTERS:
            raise ValueError(f"outer must be one of {', '.join(OUTERS)}, got {outer!r}")
        super().__init__(module)
        self.sync_every, self.outer = sync_every, str(outer)
        self.steps = 0  # optimizer steps taken
        self._params = self.trainable_parameters()
        self._buffers_averaged = averaged_buffers(module)
        self._outer_optimizer = None
        self._optimizer = None  # a weak reference to the optimizer make_optimizer built
        if self.outer == "nesterov" and self._params:
            with torch.no_grad():
                self._anchor = _flatten_dense_tensors([p.detach() for p in self._params]).clone()  # θ at the last sync
            self._outer_optimizer = torch.optim.SGD([self._anchor], lr=OUTER_LR, momentum=OUTER_MOMENTUM,
                                                    nesterov=True)

    def kept_tensors(self) -> list[torch.Tensor]:
        """DiLoCo's outer state: θ at the last sync and the outer optimizer's momentum."""
        if self._outer_optimizer is None:
            return []
        return [self._anchor] + [t for s in self._outer_optimizer.state.values() for t in s.values()
                                 if torch.is_tensor(t)]

    def finish_gradient_synchronization(self) -> None:
        """Nothing to synchronize: each rank steps on its own gradients."""

    # --- checkpoints: each rank's own model between syncs, and the rank average for any other load ---------

    def _optimizer_state(self) -> list[torch.Tensor]:
        """This rank's optimizer state tensors (AdamW's moments), parameter by parameter; not its step counts,
        which every rank shares."""
        optimizer = self._optimizer() if self._optimizer is not None else None
        if optimizer is None:
            return []
        return [t for p in self._params for key, t in sorted(optimizer.state.get(p, {}).items())
                if torch.is_tensor(t) and key != "step"]

    def checkpoint_rank_state(self) -> dict[str, torch.Tensor]:
        """Steps since the start, this rank's own parameters, buffers and optimizer moments (they differ from
        the other ranks' between syncs), and DiLoCo's outer state (θ at the last sync, the outer momentum)."""
        own = [p.data for p in self._params] + self._buffers_averaged
        state = {"local_sgd.steps": torch.tensor([self.steps], dtype=torch.int64)}
        if own:
            state["local_sgd.model"] = _flatten_dense_tensors(own)
        moments = self._optimizer_state()
        if moments:
            state["local_sgd.optimizer"] = _flatten_dense_tensors(moments)
        if self._outer_optimizer is not None:
            state["local_sgd.anchor"] = self._anchor.detach().clone()
            momentum = self._outer_optimizer.state.get(self._anchor, {}).get("momentum_buffer")
            if momentum is not None:
                state["local_sgd.outer_momentum"] = momentum.detach().clone()
        return state

    @contextmanager
    def checkpoint_consensus(self, optimizer):
        """The checkpoint's parameters, buffers and optimizer moments are the rank average (one all-reduce,
        outside any step's figures): what another strategy, or another world size, starts from. Each rank's
        own come back after the save, and are in its `checkpoint_rank_state`."""
        tensors = [p.data for p in self._params] + self._buffers_averaged + self._optimizer_state()
        own = [t.clone() for t in tensors]
        with torch.no_grad():
            if tensors:
                flat = _flatten_dense_tensors(tensors)
                all_reduce_mean_(flat)
                for tensor, average in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                    tensor.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for tensor, mine in zip(tensors, own):
                    tensor.copy_(mine)

    @torch.no_grad()
    def load_rank_state(self, state: dict[str, torch.Tensor]) -> bool:
        """This rank's own parameters, moments and outer state as saved, where they fit; else afresh from the
        loaded (averaged) model: its steps from 0, θ at the last sync := the loaded parameters, no momentum."""
        own = [p.data for p in self._params] + self._buffers_averaged
        moments = self._optimizer_state()
        fits = ("local_sgd.steps" in state
                and state.get("local_sgd.model", torch.empty(0)).numel() == sum(t.numel() for t in own)
                and state.get("local_sgd.optimizer", torch.empty(0)).numel() == sum(t.numel() for t in moments)
                and (self._outer_optimizer is None or "local_sgd.anchor" in state))
        if self._outer_optimizer is not None:
            self._outer_optimizer.state.clear()
        if not fits:
            self.steps = 0
            if self._outer_optimizer is not None:
                self._anchor.copy_(_flatten_dense_tensors([p.detach() for p in self._params]))
            return False
        self.steps = int(state["local_sgd.steps"].item())
        for group, key in ((own, "local_sgd.model"), (moments, "local_sgd.optimizer")):
            if group:
                for tensor, saved in zip(group, _unflatten_dense_tensors(state[key], group)):
                    tensor.copy_(saved)
        if self._outer_optimizer is not None:
            self._anchor.copy_(state["local_sgd.anchor"])
            if "local_sgd.outer_momentum" in state:
                momentum = state["local_sgd.outer_momentum"].to(self._anchor.device, copy=True)  # read on the CPU
                self._outer_optimizer.state[self._anchor]["momentum_buffer"] = momentum
        return True

    def facts(self) -> dict:
        sync_bytes = sum(tensor_bytes(t) for t in self._params + self._buffers_averaged)
        outer = {"outer_lr": OUTER_LR, "outer_momentum": OUTER_MOMENTUM} if self._outer_optimizer else {}
        return {"local_sgd": {"sync_every": self.sync_every, "outer": self.outer, "bytes_per_sync": sync_bytes,
                              **outer}}

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], params=None,
                       **kwargs) -> torch.optim.Optimizer:
        """The plain optimizer, whose every step is followed by `after_step()`."""
        optimizer = super().make_optimizer(optimizer_cls, params, **kwargs)
        self._optimizer = weakref.ref(optimizer)  # whose moments a checkpoint saves for this rank
        this = weakref.ref(self)  # the hook must not keep a discarded wrapper alive

        def hook(optimizer, args, kwargs) -> None:
            wrapper = this()
            if wrapper is not None:
                wrapper.after_step()

        optimizer.register_step_post_hook(hook)
        return optimizer

    def after_step(self) -> None:
        self.steps += 1
        if self.steps % self.sync_every == 0:
            with self.comm.exposed(in_optimizer=True):
                self.average()

    @torch.no_grad()
    def average(self) -> None:
        """Every rank's trainable parameters and buffers := their rank average (then the outer step)."""
        tensors = [p.data for p in self._params] + self._buffers_averaged
        if not tensors:
            return
        flat = _flatten_dense_tensors(tensors)
        with self.comm.timed(tensor_bytes(flat)):
            all_reduce_mean_(flat)
        if self._outer_optimizer is not None:
            mean = flat[:self._anchor.numel()]
            self._anchor.grad = self._anchor - mean  # the pseudo-gradient Δ = θ - θ̄
            self._outer_optimizer.step()
            self._anchor.grad = None  # Δ is used once: not kept until the next sync
            mean.copy_(self._anchor)
        for tensor, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            tensor.copy_(synced)
