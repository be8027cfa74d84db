"""ShardedOptimizer: ZeRO stage 1, optimizer state split over ranks by whole parameters.

Plain data parallelism keeps a full copy of the optimizer state on every rank (AdamW: two floats
per parameter, twice the weights). Here each parameter has one owner rank; only the owner keeps its
state and computes its update, and the updated values are then shared so every rank ends the step
with identical parameters.

Owners are whole parameters balanced by bytes (ownership.py); checkpoints are consolidated into
the plain optimizer's layout (checkpoint.py).

Communication, `comm=`: payload per step for P parameter bytes and G gradient bytes, and bytes
over each rank's link in nccl-tests' bus convention for N ranks (ddp_lab/analysis/calculator.py's):

- `allreduce_broadcast` (the CS336 simplification; default): the gradient-sync wrapper all-reduces
  every gradient (payload G, 2(N-1)/N * G on the link), each owner updates its shard and
  broadcasts its updated parameters, one broadcast per parameter straight into every rank's
  copy, all in flight at once (payload P). Every rank receives what it does not own, and on
  gloo the lab's chain broadcasts (strategies/rings.py) forward it along the ring, so each
  rank's link carries (N-1)/N * P, an all-gather's bytes. In all 2(N-1)/N * G + (N-1)/N * P:
  1.5x an all-reduce's bytes at any N.
- `reduce_scatter` (ZeRO-1 as the paper describes it): gradients are summed only onto their owner
  (reduce-scatter, (N-1)/N * G), the owner updates, and everyone gathers the updated parameters
  (all-gather, (N-1)/N * P): with P = G exactly one all-reduce's bytes. After the reduce-scatter a
  rank drops (sets to None) the gradients of parameters it does not own: only the owner needs
  them. Both are one collective per (device, dtype) over the owners' segments, by the implementation
  `backend.collectives` chooses (strategies/collectives.py): the lab's rings (gloo's default) take the
  segments at their exact sizes, payload G + P; the backend's own (nccl; gloo's, whose reduce-scatter
  is an all-reduce underneath) take equal rows, so the segments are padded to the largest shard:
  payload N x largest shard each way, a few % over P for a Transformer's balanced shards, up to N x
  when one tensor dominates.

Either way the caller need not change: `step()` reduce-scatters the gradients itself unless the
zero1 wrapper already did it in `finish_gradient_synchronization()` (strategy.py).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors

from ddp_lab.spec.choices import ZeroComm
from ddp_lab.strategies.collectives import all_gather, broadcasts, casts, collectives_in_use, reduce_scatter, to_wire
from ddp_lab.strategies.shard_optimizer import ShardOptimizerBase
from ddp_lab.strategies.zero1.checkpoint import ConsolidatedStateDict
from ddp_lab.strategies.zero1.ownership import assign_owners
from ddp_lab.units import tensor_bytes


class ShardedOptimizer(ConsolidatedStateDict, ShardOptimizerBase):
    """`optimizer_cls` on this rank's shard of `params`; every rank sees every parameter updated.

    `params`: tensors (a generator is fine) or param groups with their own hyperparameters;
    `kwargs` go to `optimizer_cls`. `param_groups` lists every parameter with the full set of the
    inner optimizer's hyperparameters, so LR schedulers work on it; changes made there are copied
    into the inner optimizer before each step. `state` is this rank's state only (the owner's).
    `comm` picks the communication pattern (module docstring); `comm_stats`, when set (the zero1
    strategy sets it to the wrapper's `CommStats`), records this optimizer's collectives.
    `grad_dtype` (the zero1 strategy passes its comm_dtype's): the dtype gradients are
    reduce-scattered in (None: their own); the averaged result lands in the fp32 `.grad`. The
    updated parameters travel in their own dtype.
    `process_group` (as torch's ZeroRedundancyOptimizer takes it): the ranks the state is sharded over (None:
    all of them; the data-parallel axis of a mesh); owners are its ranks.
    Without an initialized process group it runs as one rank holding everything.
    """

    def __init__(self, params: Iterable, optimizer_cls: type[torch.optim.Optimizer], *,
                 comm: str = ZeroComm.allreduce_broadcast, comm_stats=None, grad_dtype: torch.dtype | None = None,
                 process_group=None, **kwargs: Any):
        if comm not in set(ZeroComm):
            raise ValueError(f"unknown comm {comm!r}; options: {', '.join(ZeroComm)}")
        self.comm_mode = ZeroComm(comm)
        self.grad_dtype = grad_dtype
        self.process_group = process_group
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.world_size = dist.get_world_size(process_group) if distributed else 1
        # ring or native (strategies/collectives.py), what `backend.collectives` chose; tests pin one per instance
        self.collectives = collectives_in_use(process_group) if distributed else "native"
        self.owner: dict[torch.Tensor, int] = {}
        self.loads = [0] * self.world_size  # parameter bytes owned by each rank
        self._grads_reduced = False
        super().__init__(params, optimizer_cls, comm_stats=comm_stats, **kwargs)

    def _local_group(self, group: dict) -> dict:
        """Owners for the group's params (balanced on top of earlier groups); the ones this rank owns."""
        owners = assign_owners([tensor_bytes(p) for p in group["params"]], self.world_size, self.loads)
        self.owner.update(zip(group["params"], owners))
        mine = [i for i, owner in enumerate(owners) if owner == self.rank]
        local = {"params": [group["params"][i] for i in mine]}
        if "param_names" in group:
            local["param_names"] = [group["param_names"][i] for i in mine]
        return local

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._grads_reduced = False

    def _before_update(self) -> None:
        if self.comm_mode == ZeroComm.reduce_scatter and not self._grads_reduced:
            with self._exposed():
                self.reduce_scatter_gradients()

    def _share_updates(self) -> None:
        if self.comm_mode == ZeroComm.reduce_scatter:
            self._all_gather_params()
        else:
            self._broadcast_params()
        self._grads_reduced = False

    def _trainable_by_owner(self) -> dict[tuple, list[list[torch.Tensor]]]:
        """{(device, dtype): [params of rank 0, params of rank 1, ...]}, in param_groups order.

        Frozen parameters never change, so they are never sent; requires_grad agrees on all ranks.
        """
        layout: dict[tuple, list[list[torch.Tensor]]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    per_owner = layout.setdefault((p.device, p.dtype), [[] for _ in range(self.world_size)])
                    per_owner[self.owner[p]].append(p)
        return layout

    def _broadcast_params(self) -> None:
        """Each owner broadcasts its updated params straight into every rank's copy; all at once.

        One broadcast per parameter (by `backend.collectives`: the lab's chain broadcasts on gloo, one
        ring job for them all), into the parameter itself: no flat buffer to fill on
        the owner or to copy out of elsewhere (that copy and a fresh buffer per step made this
        2x slower on gloo; measured in docs/benchmarks.md, "ZeRO-1"). Every rank issues the
        calls in the same order (by dtype, then owner, then param_groups order).
        """
        if self.world_size == 1:
            return
        pending = [(p, owner) for per_owner in self._trainable_by_owner().values()
                   for owner, params in enumerate(per_owner) for p in params]
        with self._timed(sum(tensor_bytes(p) for p, _ in pending), len(pending)):
            buffers = [p.detach().contiguous() for p, _ in pending]  # the parameter itself unless not contiguous
            for work in broadcasts(buffers, [owner for _, owner in pending], group=self.process_group,
                                   implementation=self.collectives):
                work.wait()
            for (p, _), buffer in zip(pending, buffers):
                if buffer.data_ptr() != p.data_ptr():
                    p.copy_(buffer)

    @torch.no_grad()
    def reduce_scatter_gradients(self) -> None:
        """ZeRO-1's gradient half: each owner gets the rank-average of its params' gradients.

        Called by the zero1 wrapper's `finish_gradient_synchronization()` or else by `step()`;
        once per step (a second call before `step()`/`zero_grad()` does nothing). A parameter
        with no gradient on this rank contributes zeros; its owner keeps `grad=None` when it has
        none itself (as NaiveDDP, this assumes all ranks agree on which parameters were used).
        Other ranks drop their copy (`grad=None`): only the owner needs it.
        """
        if self.comm_mode != ZeroComm.reduce_scatter or self._grads_reduced:
            return
        self._grads_reduced = True
        if self.world_size == 1:
            return
        for (device, dtype), per_owner in self._trainable_by_owner().items():
            flat, sizes = self._owner_rows([self._flat_grads(params, dtype, device) for params in per_owner])
            if casts(flat, self.grad_dtype):  # comm_dtype: divided and cast first, the mean arrives
                flat = to_wire(flat, self.grad_dtype, self.world_size)
            mine = torch.empty(sizes[self.rank], dtype=flat.dtype, device=flat.device)
            with self._timed(tensor_bytes(flat)):
                reduce_scatter(mine, flat, group=self.process_group, sizes=sizes, implementation=self.collectives)
            if mine.dtype == dtype:
                mine.div_(self.world_size)
            for owner, params in enumerate(per_owner):
                if owner != self.rank:
                    for p in params:
                        p.grad = None
                else:
                    for p, value in zip(params, _split(mine, params)):
                        if p.grad is not None:
                            p.grad.copy_(value)

    def _row_sizes(self, sizes: list[int]) -> list[int]:
        """The owners' segments as rows: exact sizes for the lab's ring, each padded to the largest for the
        backend's own collectives, which take equal rows."""
        return [max(sizes)] * len(sizes) if self.collectives == "native" else sizes

    def _owner_rows(self, flats: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        sizes = self._row_sizes([f.numel() for f in flats])
        return torch.cat([torch.nn.functional.pad(f, (0, size - f.numel())) for f, size in zip(flats, sizes)]), sizes

    @staticmethod
    def _flat_grads(params, dtype, device) -> torch.Tensor:
        parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype, device=device)
                 for p in params]
        return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)

    @torch.no_grad()
    def _all_gather_params(self) -> None:
        """ZeRO-1's parameter half: every rank receives every owner's updated parameters, one all-gather
        over the owners' segments (exact sizes with the ring, padded with the backend's own)."""
        if self.world_size == 1:
            return
        for (device, dtype), per_owner in self._trainable_by_owner().items():
            sizes = self._row_sizes([sum(p.numel() for p in params) for params in per_owner])
            mine = self._flat_params(per_owner[self.rank], dtype, device)
            mine = torch.nn.functional.pad(mine, (0, sizes[self.rank] - mine.numel()))
            gathered = torch.empty(sum(sizes), dtype=dtype, device=device)
            with self._timed(tensor_bytes(gathered)):
                all_gather(gathered, mine, group=self.process_group, sizes=sizes, implementation=self.collectives)
            for owner, (params, segment) in enumerate(zip(per_owner, gathered.split(sizes))):
                if owner != self.rank:
                    for p, value in zip(params, _split(segment, params)):
                        p.copy_(value)

    @staticmethod
    def _flat_params(params, dtype, device) -> torch.Tensor:
        return (_flatten_dense_tensors([p.detach() for p in params]) if params
                else torch.empty(0, dtype=dtype, device=device))


def _split(flat: torch.Tensor, params: list[torch.Tensor]):
    """Views of `flat` shaped like `params`, in order (the inverse of flattening them)."""
    offset = 0
    for p in params:
        yield flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
