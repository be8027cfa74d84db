"""`measure.grad_error=true`: each step, how far the gradient a strategy delivered is from the exact
fp32 average of the ranks' gradients.

    grad_error = ||delivered - exact|| / ||exact||     (over every trainable element, once each)

- exact: every rank's own gradient, captured by a post-accumulate-grad hook registered on the model
  *before* the strategy wraps it (hooks run in registration order, so it sees the rank's gradient
  before any strategy's hook sends it; with gradient accumulation or a pipeline's micro-batches the last
  capture is the sum), averaged in fp32 as the strategy averages it: over each parameter's replicas, summed
  and divided by their count (`Parallelism.averaging()`: on a mesh the data-parallel ranks, dp x cp, never the
  tensor-parallel or pipeline ranks, whose pieces differ; under expert parallelism an expert's copies, divided by
  dp x cp), one all-reduce per class of parameters (the measurement's cost: one gradient-sized all-reduce per
  step, hence off by default).
- delivered: what the optimizer reads on this rank after `finish_gradient_synchronization()`: the
  `.grad` of the tensors its (inner, for sharded optimizers) param groups hold. Those are the
  parameters themselves, or slices of them that share their storage (zero2's shards), so each is
  matched to the parameter it lies in by storage and offset.
- The squared error and squared norm are summed over this rank's tensors and then over ranks (one
  all-reduce of three numbers), each element once: a slice (a sharded strategy's part) counts on the rank
  holding it, a whole parameter (replicated on its class's group) counts 1 / the group's size on each rank.
  A weight every tensor-parallel rank holds whole (a norm, a row-parallel bias) counts once per TP rank.

fp16's loss scale multiplies both sides alike (the probe runs before the unscale), so the ratio is
the same. Returns {} (nothing recorded) where the optimizer's tensors are not parameters or slices of
them (a strategy that replaces the parameters, as fsdp does): the probe cannot see the delivered
gradient there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.rank.memory import local_optimizer


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, first element, end element) of a contiguous tensor."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), t.storage_offset() + t.numel()


class GradErrorProbe:
    def __init__(self, module: nn.Module, averaging=None):
        """`averaging`: the strategy's replica map (Parallelism.averaging()); None: one class over every rank."""
        from ddp_lab.strategies.replicas import ReplicaMap

        self.averaging = averaging or ReplicaMap.single()
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.local: dict[int, torch.Tensor] = {}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._capture)

    def _capture(self, param: torch.Tensor) -> None:
        self.local[id(param)] = param.grad.detach().clone()

    @torch.no_grad()
    def measure(self, optimizer: torch.optim.Optimizer) -> dict:
        """{"grad_error": relative error} for this step (every rank calls it), or {} when it cannot see."""
        if not self.params:
            return {}
        like = self.params[0]
        exact, copies = {}, {}
        for replica, params in self.averaging.split(self.params):
            flat = torch.cat([self.local.get(id(p), torch.zeros_like(p)).reshape(-1).float() for p in params])
            dist.all_reduce(flat, group=replica.group)
            flat.div_(replica.divisor)
            offset = 0
            for p in params:
                exact[id(p)] = (p, flat[offset:offset + p.numel()])
                copies[id(p)] = dist.get_world_size(replica.group)
                offset += p.numel()
        self.local.clear()
        sums = torch.zeros(3, dtype=torch.float64, device=like.device)  # squared error, squared norm, unmatched
        for group in local_optimizer(optimizer).param_groups:
            for t in group["params"]:
                if t.grad is None:
                    continue
                match = self._exact_part(t, exact)
                if match is None:
                    sums[2] += 1
                    continue
                share = 1 / copies[id(t)] if id(t) in exact else 1.0  # a whole parameter: every copy adds it
                delivered = t.grad.reshape(-1).double()
                sums[0] += share * (delivered - match.double()).square().sum()
                sums[1] += share * match.double().square().sum()
        dist.all_reduce(sums)
        if sums[2] > 0 or sums[1] == 0:
            return {}
        return {"grad_error": (sums[0] / sums[1]).sqrt().item()}

    @staticmethod
    def _exact_part(t: torch.Tensor, exact: dict) -> torch.Tensor | None:
        """The exact average of the elements `t` holds: of its parameter, or of the part of one it is."""
        if id(t) in exact:
            return exact[id(t)][1]
        if not t.is_contiguous():
            return None
        storage, lo, hi = _span(t)
        for p, values in exact.values():
            p_storage, p_lo, p_hi = _span(p)
            if p_storage == storage and p_lo <= lo and hi <= p_hi and p.is_contiguous():
                return values[lo - p_lo:hi - p_lo]
        return None
