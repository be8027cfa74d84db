"""ShardedOptimizer: ZeRO stage 1, optimizer state split over ranks by whole parameters.

Plain data parallelism keeps a full copy of the optimizer state on every rank (AdamW: two floats
per parameter, twice the weights). Here each parameter has one owner rank; only the owner keeps its
state and computes its update, and the updated values are then shared so every rank ends the step
with identical parameters.

Ownership is by whole parameter, balanced by bytes: greedy largest-first onto the least-loaded rank
(LPT scheduling), then a repair pass of moves and swaps off the heaviest rank. Guarantee: the
heaviest rank holds at most `(4/3 - 1/(3N))` times the best possible whole-parameter split (LPT's
bound, Graham 1969; the repair only lowers the heaviest rank), and at most
`max(largest tensor, total/N + s)` with s the last tensor the greedy pass put on it. So one
dominant tensor sits alone on its rank (every whole-parameter split must hold it somewhere) with
the rest balanced over the others, and with a Transformer's many tensors the heaviest rank lands
within a norm or bias of total/N. The 4/3 is not reached in practice: tests/test_sharded_optimizer.py
checks <= 1.1 x the best split on the test models, the small Transformer at 2-16 ranks, a dominant
tensor, and LPT's textbook worst case (3,3,2,2,2 on two ranks: greedy alone 7, best 6). Owners
depend only on sizes and order, so every rank computes the same map without communicating, and a
group added later is placed on top of the current loads without moving any existing state.

Communication, `comm=`: payload per step for P parameter bytes and G gradient bytes, and bytes
over each rank's link in nccl-tests' bus convention for N ranks (ddp_lab/calculator.py's):

- `allreduce_broadcast` (the CS336 simplification; default): the gradient-sync wrapper all-reduces
  every gradient (payload G, 2(N-1)/N * G on the link), each owner updates its shard and
  broadcasts its updated parameters, one async broadcast per parameter straight into every
  rank's copy, all in flight at once (payload P, and P on the link: a broadcast's bus factor
  is 1). In all 2(N-1)/N * G + P: 1.5x an all-reduce for large N, 2x at N = 2.
- `reduce_scatter` (ZeRO-1 as the paper describes it): gradients are summed only onto their owner
  (reduce-scatter, (N-1)/N * G), the owner updates, and everyone gathers the updated parameters
  (all-gather, (N-1)/N * P): with P = G exactly one all-reduce's bytes. After the reduce-scatter a
  rank drops (sets to None) the gradients of parameters it does not own: only the owner needs
  them. On nccl this is `reduce_scatter_tensor` + `all_gather_into_tensor` over per-owner segments
  padded to the largest shard: payload N x largest shard each way, a few % over P for a
  Transformer's balanced shards, but up to N x when one tensor dominates. Gloo (torch 2.13)
  accepts those two calls but emulates reduce-scatter with a full all-reduce (pytorch PR #118911:
  2x the bytes), and here they measured 2-3x slower than an all-reduce of the same buffer; so on
  gloo the same pattern is built from what gloo does natively: per parameter, one `reduce` to its
  owner and one `broadcast` from it, in place, all in flight together, exact sizes, no padding
  (payload G + P).

Either way the caller need not change: `step()` reduce-scatters the gradients itself unless the
zero1 wrapper already did it in `finish_gradient_synchronization()` (ddp_lab/strategies/zero1.py).
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager, nullcontext
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors

ALLREDUCE_BROADCAST = "allreduce_broadcast"
REDUCE_SCATTER = "reduce_scatter"
COMM_MODES = (ALLREDUCE_BROADCAST, REDUCE_SCATTER)

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def assign_owners(sizes: list[int], world_size: int, loads: list[int] | None = None) -> list[int]:
    """Owner rank of each size: largest first onto the least-loaded rank, then repaired.

    The repair moves or swaps items off the heaviest rank while that lowers it without raising
    another rank above it (it fixes LPT's textbook worst case, sizes 3,3,2,2,2 on two ranks: 7 vs
    6). `loads` (bytes each rank already holds) is updated in place, so later groups balance on
    top of earlier ones; only the new sizes move. Deterministic: every rank computes the same
    answer from the same sizes.
    """
    loads = loads if loads is not None else [0] * world_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += sizes[i]
    while True:  # each accepted change lowers the sorted load vector, so this ends
        heavy = max(range(world_size), key=lambda r: (loads[r], -r))
        best = None  # (new max of the two ranks, item on heavy, other rank, item there or None)
        for i in (i for i in range(len(sizes)) if owners[i] == heavy):
            for j in [None] + [j for j in range(len(sizes)) if owners[j] != heavy]:
                delta = sizes[i] - (sizes[j] if j is not None else 0)
                for r in ([owners[j]] if j is not None else range(world_size)):
                    if r == heavy or delta <= 0:
                        continue
                    worst = max(loads[heavy] - delta, loads[r] + delta)
                    if worst < loads[heavy] and (best is None or worst < best[0]):
                        best = (worst, i, r, j)
        if best is None:
            return owners
        _, i, r, j = best
        delta = sizes[i] - (sizes[j] if j is not None else 0)
        owners[i], loads[heavy], loads[r] = r, loads[heavy] - delta, loads[r] + delta
        if j is not None:
            owners[j] = heavy


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class ShardedOptimizer(torch.optim.Optimizer):
    """`optimizer_cls` on this rank's shard of `params`; every rank sees every parameter updated.

    `params`: tensors (a generator is fine) or param groups with their own hyperparameters;
    `kwargs` go to `optimizer_cls`. `param_groups` lists every parameter with the full set of the
    inner optimizer's hyperparameters, so LR schedulers work on it; changes made there are copied
    into the inner optimizer before each step. `state` is this rank's state only (the owner's).
    `comm` picks the communication pattern (module docstring); `comm_stats`, when set (the zero1
    strategy sets it to the wrapper's `CommStats`), records this optimizer's collectives.
    Without an initialized process group it runs as one rank holding everything.
    """

    force_tensor_collectives: bool | None = None  # None: by backend. Tests run nccl's path on gloo.

    def __init__(self, params: Iterable, optimizer_cls: type[torch.optim.Optimizer], *,
                 comm: str = ALLREDUCE_BROADCAST, comm_stats=None, **kwargs: Any):
        if comm not in COMM_MODES:
            raise ValueError(f"unknown comm {comm!r}; options: {', '.join(COMM_MODES)}")
        self.comm_mode = comm
        self.comm_stats = comm_stats
        self.optim: torch.optim.Optimizer | None = None
        self._optimizer_cls, self._kwargs = optimizer_cls, kwargs
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        self.owner: dict[torch.Tensor, int] = {}
        self.loads = [0] * self.world_size  # parameter bytes owned by each rank
        self._grads_reduced = False
        # The inner optimizer's full defaults (betas, eps, ...) so outer groups carry every
        # hyperparameter a scheduler or a state_dict reader may look for.
        try:
            defaults = optimizer_cls([torch.zeros(1, requires_grad=True)], **kwargs).defaults
        except Exception:  # e.g. fused=True wants CUDA tensors; the real build below will say if it is wrong
            defaults = dict(kwargs)
        super().__init__(params, defaults)

    # `state` is the inner optimizer's (this rank's shard); the base constructor assigns it first.
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
        """Add a group (in the constructor or mid-training): owners for its params, local ones inner."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        owners = assign_owners([_nbytes(p) for p in group["params"]], self.world_size, self.loads)
        self.owner.update(zip(group["params"], owners))
        local = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        mine = [i for i, owner in enumerate(owners) if owner == self.rank]
        local["params"] = [group["params"][i] for i in mine]
        if "param_names" in group:
            local["param_names"] = [group["param_names"][i] for i in mine]
        if self.optim is None:
            self.optim = self._optimizer_cls([local], **self._kwargs)
            self.optim.state.update(self._early_state)
        else:
            self.optim.add_param_group(local)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._grads_reduced = False

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        if self.comm_mode == REDUCE_SCATTER and not self._grads_reduced:
            with self._exposed():
                self.reduce_scatter_gradients()
        self.optim.step(**kwargs)
        with self._exposed():
            if self.comm_mode == REDUCE_SCATTER:
                self._all_gather_params()
            else:
                self._broadcast_params()
        self._grads_reduced = False
        return loss

    def _sync_hyperparameters(self) -> None:
        """Outer groups are what users and schedulers edit; the inner optimizer follows them."""
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            for key, value in outer.items():
                if key not in ("params", "param_names"):
                    inner[key] = value

    # ----- communication -------------------------------------------------------------------

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

    def _exposed(self):
        return self.comm_stats.exposed(in_optimizer=True) if self.comm_stats is not None else nullcontext()

    @contextmanager
    def _timed(self, nbytes: int, calls: int = 1):
        """One interval for `calls` collectives launched together (they are in flight together)."""
        if self.comm_stats is None:
            yield
            return
        with self.comm_stats.timed(nbytes):
            yield
        self.comm_stats.collectives += calls - 1

    def _broadcast_params(self) -> None:
        """Each owner broadcasts its updated params straight into every rank's copy; all at once.

        One async broadcast per parameter, into the parameter itself: no flat buffer to fill on
        the owner or to copy out of elsewhere (that copy and a fresh buffer per step made this
        2x slower on gloo; measured in docs/benchmarks.md, "ZeRO-1"). Every rank issues the
        calls in the same order (by dtype, then owner, then param_groups order).
        """
        if self.world_size == 1:
            return
        pending = [(p, owner) for per_owner in self._trainable_by_owner().values()
                   for owner, params in enumerate(per_owner) for p in params]
        with self._timed(sum(_nbytes(p) for p, _ in pending), len(pending)):
            works = []
            for p, owner in pending:
                buffer = p.detach().contiguous()  # the parameter itself unless it is not contiguous
                works.append((p, buffer, dist.broadcast(buffer, src=owner, async_op=True)))
            for p, buffer, work in works:
                work.wait()
                if buffer.data_ptr() != p.data_ptr():
                    p.copy_(buffer)

    def _use_tensor_collectives(self) -> bool:
        """nccl: reduce_scatter/all_gather proper. Gloo emulates them badly (module docstring)."""
        if self.force_tensor_collectives is not None:
            return self.force_tensor_collectives
        return dist.get_backend() == "nccl"

    @torch.no_grad()
    def reduce_scatter_gradients(self) -> None:
        """ZeRO-1's gradient half: each owner gets the rank-average of its params' gradients.

        Called by the zero1 wrapper's `finish_gradient_synchronization()` or else by `step()`;
        once per step (a second call before `step()`/`zero_grad()` does nothing). A parameter
        with no gradient on this rank contributes zeros; its owner keeps `grad=None` when it has
        none itself (as NaiveDDP, this assumes all ranks agree on which parameters were used).
        Other ranks drop their copy (`grad=None`): only the owner needs it.
        """
        if self.comm_mode != REDUCE_SCATTER or self._grads_reduced:
            return
        self._grads_reduced = True
        if self.world_size == 1:
            return
        for (device, dtype), per_owner in self._trainable_by_owner().items():
            if self._use_tensor_collectives():
                self._padded_reduce_scatter(per_owner, dtype, device)
            else:
                self._reduce_to_owners(per_owner)

    def _reduce_to_owners(self, per_owner: list[list[torch.Tensor]]) -> None:
        """Gloo's reduce-scatter: one async `reduce` per parameter, in place, to its owner."""
        pending = []
        for owner, params in enumerate(per_owner):
            for p in params:
                grad = p.grad.contiguous() if p.grad is not None else torch.zeros_like(p)
                pending.append((p, owner, grad))
        with self._timed(sum(_nbytes(g) for *_, g in pending), len(pending)):
            works = [dist.reduce(grad, dst=owner, async_op=True) for _, owner, grad in pending]
            for work in works:
                work.wait()
        for p, owner, grad in pending:
            if owner != self.rank:
                p.grad = None
            elif p.grad is not None:
                if grad.data_ptr() != p.grad.data_ptr():
                    p.grad.copy_(grad)
                p.grad.div_(self.world_size)

    def _padded_reduce_scatter(self, per_owner: list[list[torch.Tensor]], dtype, device) -> None:
        """nccl: one reduce_scatter over owner segments padded to the largest shard."""
        flats = [self._flat_grads(params, dtype, device) for params in per_owner]
        width = max(f.numel() for f in flats)
        padded = torch.cat([torch.nn.functional.pad(f, (0, width - f.numel())) for f in flats])
        mine = torch.empty(width, dtype=padded.dtype, device=padded.device)
        with self._timed(_nbytes(padded)):
            _reduce_scatter_single(mine, padded)
        mine.div_(self.world_size)
        for owner, params in enumerate(per_owner):
            if owner != self.rank:
                for p in params:
                    p.grad = None
            else:
                for p, value in zip(params, _split(mine, params)):
                    if p.grad is not None:
                        p.grad.copy_(value)

    @staticmethod
    def _flat_grads(params, dtype, device) -> torch.Tensor:
        parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype, device=device)
                 for p in params]
        return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)

    @torch.no_grad()
    def _all_gather_params(self) -> None:
        """ZeRO-1's parameter half: every rank receives every owner's updated parameters.

        nccl: one all_gather over owner segments padded to the largest shard. Gloo: the
        per-parameter broadcasts of `_broadcast_params` (exact sizes, no padding).
        """
        if self.world_size == 1:
            return
        if not self._use_tensor_collectives():
            self._broadcast_params()
            return
        for (device, dtype), per_owner in self._trainable_by_owner().items():
            width = max(sum(p.numel() for p in params) for params in per_owner)
            mine = torch.zeros(width, dtype=dtype, device=device)
            if per_owner[self.rank]:
                flat = _flatten_dense_tensors([p.detach() for p in per_owner[self.rank]])
                mine[:flat.numel()] = flat
            gathered = torch.empty(width * self.world_size, dtype=dtype, device=device)
            with self._timed(_nbytes(gathered)):
                _all_gather_single(gathered, mine)
            for owner, (params, segment) in enumerate(zip(per_owner, gathered.split(width))):
                if owner != self.rank:
                    for p, value in zip(params, _split(segment, params)):
                        p.copy_(value)

    # ----- checkpoints ---------------------------------------------------------------------

    def _global_index(self) -> dict[torch.Tensor, int]:
        """Position of each param in param_groups order: torch's own state_dict numbering."""
        return {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def state_dict(self, to: int | None = None) -> dict | None:
        """The whole optimizer's state, in the format a plain `optimizer_cls` uses. Collective.

        Same layout as `torch.optim.Optimizer.state_dict()` (state keyed by global parameter
        index, param_groups with every hyperparameter), so it loads into a plain optimizer too,
        and into a ShardedOptimizer on any world size. All ranks must call it. Each owner sends
        its state tensors as one flat buffer per dtype (one broadcast per owner, or one send to
        rank `to`); only shapes and dtypes travel as pickled objects, and the result is held on
        the CPU, so device memory grows by at most one owner's flat buffer. (torch's
        ZeroRedundancyOptimizer pickles every rank's state dict whole through
        broadcast_object_list, one rank after another, through device memory.) With `to=None`
        every rank gets the dict; with `to=r` only rank r does and the others get None.
        """
        self._sync_hyperparameters()
        index = self._global_index()
        params = {i: p for p, i in index.items()}
        # {global index: {key: ("tensor", shape, dtype) | ("value", python value)}}, per owner.
        local_meta = {index[p]: {k: ("tensor", tuple(v.shape), v.dtype) if torch.is_tensor(v) else ("value", v)
                                 for k, v in s.items()}
                      for p, s in self.optim.state.items()}
        metas = [local_meta]
        if self.world_size > 1:
            metas = [None] * self.world_size
            dist.all_gather_object(metas, local_meta)
        receive = to is None or to == self.rank
        device = self._comm_device()
        state: dict[int, dict] = {}
        for owner, meta in enumerate(metas):
            if to is not None and self.rank not in (owner, to):
                continue  # neither sends nor receives this owner's state
            per_dtype = defaultdict(list)  # dtype -> [(index, key, shape)]: the same order on every rank
            for i in sorted(meta):
                for key, (kind, *rest) in meta[i].items():
                    if kind == "tensor":
                        per_dtype[rest[1]].append((i, key, rest[0]))
                    elif receive:
                        state.setdefault(i, {})[key] = rest[0]
            for dtype, entries in per_dtype.items():
                if owner == self.rank:
                    flat = torch.cat([self.optim.state[params[i]][key].detach().reshape(-1).to(device)
                                      for i, key, _ in entries])
                else:
                    flat = torch.empty(sum(_numel(shape) for *_, shape in entries), dtype=dtype, device=device)
                if to is None:
                    if self.world_size > 1:
                        dist.broadcast(flat, src=owner)
                elif owner != to:
                    if owner == self.rank:
                        dist.send(flat, dst=to)
                    else:
                        dist.recv(flat, src=owner)
                if receive:
                    flat, offset = flat.cpu(), 0
                    for i, key, shape in entries:
                        n = _numel(shape)
                        state.setdefault(i, {})[key] = flat[offset:offset + n].view(shape).clone()
                        offset += n
        if not receive:
            return None
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [index[p] for p in group["params"]]} for group in self.param_groups]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def _comm_device(self) -> torch.device:
        """Where collectives run: the parameters' CUDA device under nccl, else the CPU."""
        if self.world_size > 1 and dist.get_backend() == "nccl":
            return next(p.device for g in self.param_groups for p in g["params"])
        return torch.device("cpu")

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from a consolidated dict (ours or a plain optimizer's), on any world size.

        Every rank passes the whole dict; each keeps (a copy of) the state of the parameters it
        owns under this world size's owner map, so re-sharding is nothing more than reading other
        entries.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(saved_groups)} param groups, this optimizer {len(self.param_groups)}")
        for group, saved in zip(self.param_groups, saved_groups):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError("a param group's size differs from the one in the state_dict")
        inner_state, inner_groups, local_i = {}, [], 0
        for group, saved in zip(self.param_groups, saved_groups):
            hyper = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
            group.update(hyper)
            inner_params = []
            for p, saved_i in zip(group["params"], saved["params"]):
                if self.owner[p] != self.rank:
                    continue
                if saved_i in state_dict["state"]:  # copied: training must not write into the caller's dict
                    inner_state[local_i] = {k: v.clone() if torch.is_tensor(v) else v
                                            for k, v in state_dict["state"][saved_i].items()}
                inner_params.append(local_i)
                local_i += 1
            inner_groups.append({**hyper, "params": inner_params})
        self.optim.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        self._sync_hyperparameters()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _split(flat: torch.Tensor, params: list[torch.Tensor]):
    """Views of `flat` shaped like `params`, in order (the inverse of flattening them)."""
    offset = 0
    for p in params:
        yield flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
