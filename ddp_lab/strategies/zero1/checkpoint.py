"""ZeRO-1 checkpoints: one consolidated optimizer state dict, loadable on any world size.

`ConsolidatedStateDict` gives ShardedOptimizer `state_dict()` and `load_state_dict()` in the plain
optimizer's layout (state keyed by global parameter index, param_groups with every
hyperparameter), so a checkpoint loads into a plain optimizer too, and into a ShardedOptimizer on
any world size: re-sharding is nothing more than each rank reading other entries.

torch's ZeroRedundancyOptimizer pickles every rank's state dict whole through
broadcast_object_list, one rank after another, through device memory (its users report slow and
memory-hungry consolidation). Here each owner sends its state tensors as one flat buffer per
dtype; only shapes and dtypes travel as pickled objects, and the result is held on the CPU.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist

from ddp_lab.strategies.rings import global_rank


class ConsolidatedStateDict:
    """Mixed into ShardedOptimizer: uses its `param_groups`, `owner`, `optim`, `rank`, `world_size` and
    `process_group` (ranks are its group's: `to` too)."""

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
        the CPU, so device memory grows by at most one owner's flat buffer. With `to=None`
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
            dist.all_gather_object(metas, local_meta, group=self.process_group)
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
                    flat = torch.empty(sum(math.prod(shape) for *_, shape in entries), dtype=dtype, device=device)
                group = self.process_group
                if to is None:
                    if self.world_size > 1:
                        dist.broadcast(flat, src=global_rank(group, owner), group=group)
                elif owner != to:
                    if owner == self.rank:
                        dist.send(flat, dst=global_rank(group, to), group=group)
                    else:
                        dist.recv(flat, src=global_rank(group, owner), group=group)
                if receive:
                    flat, offset = flat.cpu(), 0
                    for i, key, shape in entries:
                        n = math.prod(shape)
                        state.setdefault(i, {})[key] = flat[offset:offset + n].view(shape).clone()
                        offset += n
        if not receive:
            return None
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [index[p] for p in group["params"]]} for group in self.param_groups]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def _comm_device(self) -> torch.device:
        """Where collectives run: the parameters' CUDA device under nccl, else the CPU."""
        if self.world_size > 1 and dist.get_backend(self.process_group) == "nccl":
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
            raise ValueError(f"state_dict has {len(saved_groups)} param groups, "
                             f"this optimizer {len(self.param_groups)}")
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
