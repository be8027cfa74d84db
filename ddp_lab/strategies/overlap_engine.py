"""`OverlapEngine`: the machinery OverlapDDP and BucketedDDP share, launching all-reduces during backward.

Trainable parameters are grouped into *units* (one parameter each for OverlapDDP, a bucket for
BucketedDDP), listed in reverse `parameters()` order, roughly the order autograd finishes their
gradients. A post-accumulate-grad hook marks a parameter ready; when every parameter of a unit is
ready the unit's async all-reduce is launched, while backward goes on computing earlier layers.

Rules that keep every rank issuing the same collectives in the same order:

- Units launch strictly in list order: unit i+1 waits until unit i is launched, even when its own
  gradients are ready first (as torch DDP's reducer does). Autograd order matches the list closely,
  so this rarely delays a launch, and it means ranks can never pair different tensors in one
  collective, whatever order their gradients arrive in.
- Parameters that got no gradient this step (unused on this rank, or on every rank) never fire
  their hook, so their unit is launched by `finish_gradient_synchronization()`, still in order,
  with zeros standing in for the missing gradient. Nothing hangs; afterwards the parameter's
  `.grad` holds the rank average, identical on every rank, and a zero tensor (not None) if no rank
  used it. An optimizer with weight decay or momentum therefore still moves such a parameter.
- Frozen parameters (requires_grad False at wrap time) are in no unit and never waited for.
  Tied parameters appear once in `parameters()`, have one gradient, one hook, one reduction.
- Hooks launch only when armed: by a forward in training mode with grad enabled, outside
  `no_sync()`, and only while the backward itself is outside `no_sync()`. Evaluation forwards
  (`eval()` or `torch.no_grad()`) arm nothing. Any gradient not launched by a hook (accumulated
  under no_sync, or from an unarmed backward) is reduced by `finish_gradient_synchronization()`.
- One armed backward per synchronization: a second backward before `finish_...` raises rather
  than reducing a gradient twice; accumulate micro-batches under `no_sync()`.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ddp_lab.strategies.base import DataParallelBase
from ddp_lab.strategies.collectives import all_reduce_mean_async
from ddp_lab.strategies.comm_stats import Stamp, record_intervals


class OverlapEngine(DataParallelBase):
    def __init__(self, module: nn.Module, units: list[list[nn.Parameter]], comm_dtype: str = "fp32",
                 process_group=None, replicas=None):
        """`units`: each of one class of `replicas` (strategies/replicas.py), reduced over that class's group."""
        super().__init__(module, comm_dtype, process_group=process_group, replicas=replicas)
        self.world_size = self.dp_size
        self._units = units
        self._unit_of = {id(p): i for i, unit in enumerate(units) for p in unit}
        self._armed = False
        self._start_round()
        # A weak reference, so a discarded wrapper's hooks do nothing instead of keeping it alive.
        this = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            wrapper = this()
            if wrapper is not None:
                wrapper._on_grad_ready(param)

        self._hook_handles = [p.register_post_accumulate_grad_hook(hook) for unit in units for p in unit]

    def _start_round(self) -> None:
        self._missing = [len(unit) for unit in self._units]  # parameters not yet ready, per unit
        self._ready: set[int] = set()
        self._next_unit = 0
        self._in_flight = []  # (future, stamp) per launched unit

    def forward(self, *args, **kwargs):
        if self.training and torch.is_grad_enabled():
            self._armed = self.require_sync
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not (self._armed and self.require_sync):
            return  # accumulating locally; finish_gradient_synchronization() reduces the sum
        key = id(param)
        if key in self._ready:
            raise RuntimeError(
                "a gradient was produced twice before finish_gradient_synchronization(): "
                "run all but the last micro-batch's forward and backward inside no_sync()")
        self._ready.add(key)
        self._stage(param)
        unit = self._unit_of[key]
        self._missing[unit] -= 1
        while self._next_unit < len(self._units) and self._missing[self._next_unit] == 0:
            self._launch_next()

    def _launch_next(self) -> None:
        unit = self._units[self._next_unit]
        for param in unit:
            if id(param) not in self._ready:
                self._stage(param)
        self._in_flight.append(self._launch_unit(self._next_unit))
        self._next_unit += 1

    def _synchronize_gradients(self) -> None:
        while self._next_unit < len(self._units):
            self._launch_next()  # units whose gradients never all arrived (unused, unarmed)
        for future, _ in self._in_flight:
            future.wait()
        record_intervals([stamp for _, stamp in self._in_flight], self.comm)
        self._armed = False
        self._start_round()

    # What a subclass decides: where a ready gradient goes, and which tensor a unit reduces (or,
    # overriding `_launch_unit`, which collectives it launches: zero2 reduce-scatters instead).
    def _stage(self, param: nn.Parameter) -> None:
        raise NotImplementedError

    def _launch_unit(self, index: int) -> tuple[torch.futures.Future, Stamp]:
        """Start the unit's collective: by default the mean all-reduce of `_unit_tensor(index)`, sent in
        `comm_dtype`."""
        replica = self.replicas.of(self._units[index][0])
        return all_reduce_mean_async(self._unit_tensor(index), self.wire_dtype, group=replica.group,
                                     divisor=replica.divisor)

    def _unit_tensor(self, index: int) -> torch.Tensor:
        raise NotImplementedError
