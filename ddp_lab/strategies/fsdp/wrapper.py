"""`strategy=fsdp`: FSDP (ZeRO stage 3) written by hand: parameters, gradients and optimizer state sharded.

`FSDP(module, compute_dtype=None, reshard_after_forward=True, policy="linear_embedding",
comm_dtype=None)`. The
model is split into units (spec/strategies/fsdp_units.py) and each unit's parameters are held as local shards
(unit.py). One step:

- forward: before a unit's forward its parameters are all-gathered (waiting for the all-gather
  prefetched while the previous unit computed) and the next unit's all-gather is launched; after
  its forward, with `reshard_after_forward` (default), the gathered parameters are freed. The last
  unit of the forward is kept (its backward comes next) and so is the root (the parameters in no
  unit, e.g. a weight tied across units), as FSDP2 keeps its root.
- backward: a hook on the unit's outputs gathers it again before its backward (waiting for the
  prefetch) and launches the all-gather of the unit whose backward comes next; an autograd
  function on the unit's inputs runs after the unit's backward, folds its gradients into the
  reduction buffer, frees the gathered parameters and launches the reduction (reduce-scatter of
  the sharded gradients, all-reduce of the replicated ones) while backward goes on. A unit whose
  inputs need no gradient (the embedding) and the root are finished by a callback at the end of
  backward, in a fixed order. A unit of embeddings only is not gathered for backward (an embedding's
  backward reads only the indices), as torch's `set_unshard_in_backward(False)` does.
- `finish_gradient_synchronization()` waits for the reductions and gives every local parameter its
  averaged gradient: its own shape, the master dtype. A plain optimizer over `model.parameters()`
  (the local shards and the replicated parameters) then updates them in place.

Each rank must run the same units in the same order (the all-gathers are collectives), as with
torch's FSDP. `compute_dtype` (torch.bfloat16 / torch.float16): the shards are cast before the
all-gather, forward and backward run in it, and gradients are reduced and kept in fp32 with fp32
master weights and optimizer state. `comm_dtype` (bf16, fp16): gradients are reduced in it (half
the reduction's bytes) and land in the fp32 gradients. `no_sync()`: micro-batches add their gradients into the fp32
reduction buffers (a full gradient's worth per rank, as zero2 keeps) and only the last reduces.

Communication per step: an all-gather of each unit in forward and again in backward
(reshard_after_forward; once without it), a reduce-scatter of each unit's gradients: 2P + G, or
P + G. `comm` counts the all-gathered and reduced buffers' bytes and times them from launch to
completion; waits for an all-gather inside forward or backward are exposed communication
(`CommStats.waited`: on CPU, where the host waits; on CUDA a wait only orders streams), counted as
fsdp_torch counts FSDP2's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from ddp_lab.spec.strategies.fsdp_units import Policy, plan_units
from ddp_lab.strategies.base import DataParallelBase, compile_units
from ddp_lab.strategies.checkpoint_layout import Pieces
from ddp_lab.strategies.collectives import collectives_in_use
from ddp_lab.strategies.comm_stats import record_intervals
from ddp_lab.strategies.fsdp.unit import Unit

COMPUTE_DTYPES = (torch.float16, torch.bfloat16)


def resolve_compute_dtype(compute_dtype, what: str = "compute_dtype") -> torch.dtype | None:
    """None (compute in the parameters' dtype), torch.float16 or torch.bfloat16 (or their names)."""
    names = {"fp32": None, "float32": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16}
    if isinstance(compute_dtype, str) and compute_dtype in names:
        return names[compute_dtype]
    if compute_dtype is None or compute_dtype in COMPUTE_DTYPES:
        return compute_dtype
    if compute_dtype == torch.float32:
        return None
    raise ValueError(f"fsdp {what} must be None, torch.float16 or torch.bfloat16, got {compute_dtype!r}")


class _AfterBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done (FSDP2's trick)."""

    @staticmethod
    def forward(ctx, fsdp, unit, *inputs):
        ctx.fsdp, ctx.unit = fsdp, unit
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.fsdp._after_backward(ctx.unit)
        return (None, None, *grads)


class FSDP(DataParallelBase):
    """Hand-written FSDP behind the strategy contract (module docstring)."""

    collectives: str | None = None
    """ring or native (strategies/collectives.py); None: what `backend.collectives` chose, read when built."""

    def __init__(self, module: nn.Module, compute_dtype=None, reshard_after_forward: bool = True,
                 policy: str | Policy = "linear_embedding", comm_dtype=None, process_group=None):
        compute_dtype = resolve_compute_dtype(compute_dtype)
        wire = resolve_compute_dtype(comm_dtype, "comm_dtype")  # the same names: fp32 (as is), bf16, fp16
        plans = plan_units(module, policy)  # raises before any collective when there is nothing to shard
        super().__init__(module, process_group=process_group)  # every rank starts from rank 0's weights
        self.compute_dtype, self.reshard_after_forward = compute_dtype, reshard_after_forward
        self._on_cuda = any(p.is_cuda for p in module.parameters())
        group, replicas = self.shard_groups()
        self.collectives = self.collectives or collectives_in_use(group)
        self.units = [Unit(plan, compute_dtype, wire, group, replicas, self.collectives, process_group)
                      for plan in plans]
        self.comm_dtype = wire
        self.root = self.units[-1] if self.units[-1].module is None else None
        self._hooked = [u for u in self.units if u.module is not None]
        for unit in self._hooked:
            unit.module.register_forward_pre_hook(self._pre_forward_hook(unit), with_kwargs=True)
            unit.module.register_forward_hook(self._post_forward_hook(unit))
        self._order = list(self._hooked)       # forward order of the last forward (a guess before the first)
        self._forward: list[Unit] = []          # this forward's order
        self._stamps, self._reducing = [], []
        self._callback_queued = False
        self.peak_gathered_bytes = 0

    def shard_groups(self):
        """(the group that shards each unit, the group that holds the same shard elsewhere): every rank it
        synchronizes over (`process_group`) and nothing for fsdp; hsdp overrides it."""
        return self.process_group, None

    # --- what the trainer and users call ------------------------------------------------------------

    def forward(self, *args, **kwargs):
        self._forward = []
        for unit in self.units:
            unit.pending_backward = 0
            unit.backward_gathered = unit.backward_done = False
        if self.root is not None:
            self._launch(self.root)
        if self._order:
            self._launch(self._order[0])
        if self.root is not None:
            self._wait(self.root)
        out = self.module(*args, **kwargs)
        self._order = self._forward or self._order
        tensors = [t for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.requires_grad]
        if not tensors:  # no backward will follow (eval, no_grad): nothing stays gathered
            for unit in self.units:
                unit.reshard()
        else:
            for t in tensors:
                t.register_hook(self._root_pre_backward)
        return out

    def finish_gradient_synchronization(self) -> None:
        with self.comm.exposed():
            for unit in self._reducing:
                self._stamps += unit.assign_grads(self._on_cuda)
            self._reducing = []
            record_intervals(self._stamps, self.comm)
            self._stamps = []

    def compile_model(self, backend: str) -> None:
        """`train.compile` on its own units (`compile_units`): the gather and reshard hooks around each stay eager,
        a compiled graph sees the unit's full parameters (the same Parameter objects every step: no recompiles),
        and a unit's backward is one node between its gather and its reduction. The root's glue (the final norm,
        a tied weight) runs eager."""
        compile_units(self.module, backend, [unit.module for unit in self._hooked])

    def facts(self) -> dict:
        return {"fsdp": {"units": len(self._hooked), "root": self.root is not None,
                         "sharded_parameters": sum(len(u.sharded) for u in self.units),
                         "replicated_parameters": sum(len(u.replicated) for u in self.units),
                         "unit_gathered_mb": [u.gathered_bytes / 2**20 for u in self.units],
                         "compute_dtype": str(self.compute_dtype or "parameters'").replace("torch.", ""),
                         "comm_dtype": str(self.comm_dtype or "fp32").replace("torch.", ""),
                         "reshard_after_forward": self.reshard_after_forward}}

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter at full size in its master dtype, named as `module.named_parameters()` names
        it at rest; replicated ones as they are (copies). Collective: every rank must call it."""
        full = {}
        with torch.no_grad():
            for unit in self.units:
                full.update(unit.gather_full())
                full.update({e.name: e.param.detach().clone() for e in unit.replicated})
        return {name: full[name] for name, _ in self.module.named_parameters()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """`module.state_dict()` with every parameter at full size: a plain model loads it, and so does
        FSDP on any world size (`load_full_state_dict`). Collective: every rank must call it."""
        full = self.gather_full_params()
        by_id = {id(p): full[name] for name, p in self.module.named_parameters()}
        return {k: by_id[id(v)] if id(v) in by_id else v.detach().clone()
                for k, v in self.module.state_dict(keep_vars=True).items()}

    def checkpoint_params(self) -> Pieces:
        """Each sharded parameter's rows this rank holds (a piece at row lo's offset), replicated ones whole."""
        out = {}
        for unit in self.units:
            for entry in unit.sharded:
                lo = min(unit.rank * entry.chunk, entry.rows)
                piece = [(lo * entry.row_numel, entry.local.detach().reshape(-1))] if entry.local_rows else []
                out[entry.name] = (entry.shape, piece)
            for entry in unit.replicated:
                out[entry.name] = (tuple(entry.param.shape), [(0, entry.param.detach().reshape(-1))])
        return out

    def checkpoint_optimizer(self, optimizer) -> tuple[torch.optim.Optimizer, dict[int, tuple[str, int]]]:
        where = {}
        for unit in self.units:
            for entry in unit.sharded:
                where[id(entry.local)] = (entry.name, min(unit.rank * entry.chunk, entry.rows) * entry.row_numel)
            for entry in unit.replicated:
                where[id(entry.param)] = (entry.name, 0)
        return optimizer, where

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full (consolidated) state dict, written at any world size: each rank keeps its rows."""
        local = dict(state)
        for unit in self.units:
            for entry in unit.sharded:
                rows = entry.local.shape[0]
                lo = min(unit.rank * entry.chunk, entry.rows)
                for slot in entry.slots:
                    if slot.qualname in local:
                        local[slot.qualname] = local[slot.qualname][lo:lo + rows]
        self.module.load_state_dict(local)

    # --- gather, prefetch, reshard --------------------------------------------------------------------

    def _launch(self, unit: Unit) -> None:
        stamp = unit.launch_gather(self._on_cuda)
        if stamp is not None:
            self._stamps.append(stamp)
            self._note_peak()  # the prefetched unit's buffer exists beside the one computing

    def _wait(self, unit: Unit) -> None:
        if unit.gathered:
            return
        self._launch(unit)
        with self.comm.waited():  # exposed on CPU, where the host waits; a stream order on CUDA
            unit.wait_gathered()
        self._note_peak()

    def _note_peak(self) -> None:
        """The high-water mark of gathered parameters: units gathered or with an all-gather in flight."""
        self.peak_gathered_bytes = max(self.peak_gathered_bytes,
                                       sum(u.gathered_bytes for u in self.units if u.gathered or u.pending))

    def _neighbour(self, order: list[Unit], unit: Unit, step: int) -> Unit | None:
        if unit not in order:
            return None
        index = order.index(unit) + step
        return order[index] if 0 <= index < len(order) else None

    def _pre_forward_hook(self, unit: Unit):
        def hook(module, args, kwargs):
            self._forward.append(unit)
            self._wait(unit)
            following = self._neighbour(self._order, unit, +1)
            if following is not None and following is not unit:
                self._launch(following)
            if not torch.is_grad_enabled():
                return None
            flat, spec = tree_flatten((args, kwargs))
            positions = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
            if not positions:
                return None
            unit.pending_backward += 1
            wrapped = _AfterBackward.apply(self, unit, *(flat[i] for i in positions))
            for i, t in zip(positions, wrapped):
                flat[i] = t
            return tree_unflatten(flat, spec)
        return hook

    def _post_forward_hook(self, unit: Unit):
        def hook(module, args, output):
            last = self._order and unit is self._order[-1]
            if self.reshard_after_forward and not last:
                unit.reshard()
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if torch.is_tensor(t) and t.requires_grad:
                        t.register_hook(lambda grad, u=unit: self._pre_backward(u))
            return None
        return hook

    # --- backward --------------------------------------------------------------------------------------

    def _root_pre_backward(self, grad):
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        return None

    def _pre_backward(self, unit: Unit):
        self._root_pre_backward(None)
        if not unit.backward_gathered:
            unit.backward_gathered = True
            if unit.needed_in_backward:
                self._wait(unit)
            previous = self._neighbour(self._forward, unit, -1)
            if previous is not None and previous.needed_in_backward and not previous.backward_done:
                self._launch(previous)
        return None

    def _after_backward(self, unit: Unit) -> None:
        unit.pending_backward -= 1
        if unit.pending_backward == 0:
            self._finish_unit(unit)

    def _finish_unit(self, unit: Unit) -> None:
        if unit.backward_done:
            return
        unit.backward_done = True
        unit.fold_grads()
        unit.reshard()
        if self.require_sync and unit.has_grads():
            self._stamps += unit.launch_reduce(self._on_cuda)
            self._reducing.append(unit)

    def _end_of_backward(self) -> None:
        """Finish the units no input function finished (the embedding, the root), last-used first."""
        self._callback_queued = False
        for unit in reversed(self._forward):
            self._finish_unit(unit)
        if self.root is not None:
            self._finish_unit(self.root)
        for unit in self.units:
            if unit.pending is not None:  # a prefetch nobody used: finish it so no collective is left
                unit.wait_gathered()
            unit.reshard()
            late = [e.name for e in unit.sharded if e.full.grad is not None]
            if late:  # a gradient that reached a unit after its backward was finished would be lost
                raise RuntimeError(f"fsdp: {', '.join(late)} got a gradient after unit {unit.name or '(root)'} "
                                   "finished its backward: its inputs' gradients were computed before its own")
