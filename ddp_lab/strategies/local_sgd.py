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

    def facts(self) -> dict:
        sync_bytes = sum(tensor_bytes(t) for t in self._params + self._buffers_averaged)
        outer = {"outer_lr": OUTER_LR, "outer_momentum": OUTER_MOMENTUM} if self._outer_optimizer else {}
        return {"local_sgd": {"sync_every": self.sync_every, "outer": self.outer, "bytes_per_sync": sync_bytes,
                              **outer}}

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], params=None,
                       **kwargs) -> torch.optim.Optimizer:
        """The plain optimizer, whose every step is followed by `after_step()`."""
        optimizer = super().make_optimizer(optimizer_cls, params, **kwargs)
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
