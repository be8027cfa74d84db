"""One fsdp unit: its parameters' local shards at rest, gathered in full for its forward and backward,
its gradients reduced to the shards after its backward.

Layout. A sharded parameter of R rows is cut over dim 0 into N chunks of c = ceil(R / N) rows;
rank r holds rows [r c, min((r + 1) c, R)) (maybe fewer than c, maybe none), as torch's FSDP2 does.
Each rank's chunks of the unit's sharded parameters sit one after another in one flat fp32 buffer
of S elements, each chunk padded to c rows, so every rank's buffer has the same size S and one
`all_gather_single` of it gives the whole unit. The local parameters (what the optimizer updates
and `module.named_parameters()` lists at rest) are views into that buffer with their own shape
`(rows on this rank, *rest)`. Trainable parameters come first, so their chunks form a prefix of
S_grad elements: only that prefix is reduced.

Gather (`launch_gather`, `wait_gathered`): the flat shard (cast to the compute dtype first when one
is set) is all-gathered into a fresh N x S buffer (`all_gather` of strategies/collectives.py: on gloo
the lab's ring, unless `backend.collectives=native`), and each parameter's rows are copied out into
its *full* parameter, a persistent `nn.Parameter` whose storage is freed (resized to 0) at rest and
re-allocated at each gather. Autograd saves the full parameter in forward; freeing and
re-allocating the same storage (the trick FSDP1 and FSDP2 use) lets a unit reshard after its
forward and be gathered again into the same storage before its backward. The copies go through
`.data` so autograd's version counter does not change. The unit's modules hold the full parameters
while gathered (`module._parameters[attr]` swapped) and the local shards at rest.

Shard group (hsdp, strategies/hsdp.py): N is the shard group's size and r a rank's place in it; the
gradients are still averaged over every rank (divided by the world size), and after the reduce-scatter
inside the shard group each rank all-reduces its shard with the ranks holding the same shard in the
other groups (`replicas`). Without a shard group (fsdp) the group is the whole world.

Replicated parameters (the policy's choice: norms, biases) are whole on every rank. Without a
compute dtype the module uses them directly; with one, a persistent full parameter in the compute
dtype is filled by a cast at each gather, like the sharded ones.

Gradients (`fold_grads`, after the unit's backward): each full parameter's gradient is divided by
N and written (or, during `no_sync` accumulation, added) into a rank-major N x S_grad fp32 buffer,
row r holding the chunks rank r keeps, padding zero; replicated gradients go to a flat fp32
buffer. Then the full gradients are dropped. `launch_reduce` sums row r onto rank r (`reduce_scatter`:
on gloo the lab's ring, where gloo's own is an all-reduce underneath) and all-reduces the replicated buffer;
`assign_grads` points each local parameter's `.grad` at its part of the averaged shard (added
to a `.grad` already there, as autograd would accumulate). With a wire dtype (`comm_dtype`
bf16/fp16) the fp32 buffers are cast just before their collective (so `no_sync` accumulation
stays fp32), summed in that dtype, and the result widened back into the fp32 gradients: half the
reduction's bytes.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.spec.strategies.fsdp_units import ParamPlan, UnitPlan
from ddp_lab.strategies.collectives import all_gather, launch_stamped, reduce_scatter
from ddp_lab.units import tensor_bytes


def _allocate(tensor: torch.Tensor) -> None:
    storage, nbytes = tensor.untyped_storage(), tensor.numel() * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def _free(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


class ShardedParam:
    """One sharded parameter: where its chunk lies in the flat shard, its local and full parameters."""

    def __init__(self, plan: ParamPlan, offset: int, world_size: int, rank: int, flat: torch.Tensor,
                 compute_dtype: torch.dtype):
        p = plan.param
        self.name, self.slots, self.requires_grad = plan.name, plan.slots, p.requires_grad
        self.shape, self.rows = tuple(p.shape), p.shape[0]
        self.row_numel = math.prod(self.shape[1:])
        self.chunk = -(-self.rows // world_size)          # c: rows per rank, padded
        self.offset, self.padded = offset, self.chunk * self.row_numel
        lo = min(rank * self.chunk, self.rows)
        self.local_rows = min(self.rows, lo + self.chunk) - lo
        with torch.no_grad():
            view = flat[offset:offset + self.local_rows * self.row_numel].view(self.local_rows, *self.shape[1:])
            view.copy_(p.detach()[lo:lo + self.local_rows])
        self.local = nn.Parameter(view, requires_grad=p.requires_grad)
        self.full = nn.Parameter(torch.empty(self.shape, dtype=compute_dtype, device=p.device),
                                 requires_grad=p.requires_grad)
        self.full_data = self.full.data  # shares the storage; copies into it leave autograd's version alone
        _free(self.full_data)

    def rank_major(self, buffer: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """This parameter's columns of an N x S buffer as (N, c, *rest), and (full chunks q, rows in the next)."""
        n = buffer.shape[0]
        part = buffer[:, self.offset:self.offset + self.padded].unflatten(1, (self.chunk, *self.shape[1:]))
        q, rem = divmod(self.rows, self.chunk)
        return part, min(q, n), rem if q < n else 0

    def copy_out(self, gathered: torch.Tensor, full: torch.Tensor) -> None:
        """Fill `full` (this parameter at full size) from the all-gathered N x S buffer."""
        part, q, rem = self.rank_major(gathered)
        full[:q * self.chunk].view(q, self.chunk, *self.shape[1:]).copy_(part[:q])
        if rem:
            full[q * self.chunk:].copy_(part[q, :rem])

    def fold_grad(self, packed: torch.Tensor, grad: torch.Tensor | None, scale: float, first: bool) -> None:
        """Write (first) or add `grad * scale` into this parameter's columns of the N x S_grad buffer."""
        part, q, rem = self.rank_major(packed)
        if grad is None:
            if first:
                part.zero_()
            return
        whole = grad[:q * self.chunk].view(q, self.chunk, *self.shape[1:])
        if first:
            scaled_into(part[:q], whole, scale)
            part[q:].zero_()
            if rem:
                scaled_into(part[q, :rem], grad[q * self.chunk:], scale)
        else:
            part[:q].add_(whole, alpha=scale)
            if rem:
                part[q, :rem].add_(grad[q * self.chunk:], alpha=scale)


class ReplicatedParam:
    def __init__(self, plan: ParamPlan, offset: int, compute_dtype: torch.dtype | None):
        p = plan.param
        self.param, self.name, self.slots, self.offset = p, plan.name, plan.slots, offset
        self.cast = compute_dtype is not None and compute_dtype != p.dtype
        if self.cast:
            self.full = nn.Parameter(torch.empty_like(p, dtype=compute_dtype), requires_grad=p.requires_grad)
            self.full_data = self.full.data
            _free(self.full_data)
        else:
            self.full = p


class Unit:
    """A unit's shards, its gathered state and its gradient reduction (module docstring)."""

    def __init__(self, plan: UnitPlan, compute_dtype: torch.dtype | None,
                 wire_dtype: torch.dtype | None = None, group=None, replicas=None, collectives: str | None = None,
                 data_group=None):
        """`group` shards the unit, `replicas` hold the same shard elsewhere (hsdp), `data_group` is every rank
        the gradients average over (the shard groups and their replicas; a mesh's data-parallel axis); None for
        any of them: the whole world."""
        self.name, self.module = plan.name, plan.module
        self.wire_dtype = wire_dtype
        self.group, self.replicas = group, replicas  # None: the whole world shards, nothing replicates
        self.data_group = data_group
        self.collectives = collectives  # ring or native (strategies/collectives.py); None: as chosen
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.scale = 1.0 / dist.get_world_size(data_group)  # an average over every data-parallel rank
        first = plan.params[0].param
        self.device, self.dtype = first.device, first.dtype
        if any(p.param.dtype != self.dtype for p in plan.params):
            raise ValueError(f"fsdp unit {self.name or '(root)'}: all its parameters must share one dtype")
        self.compute_dtype = compute_dtype or self.dtype
        sharded = sorted(plan.sharded, key=lambda p: not p.param.requires_grad)  # trainable first: a prefix
        size = sum(-(-p.param.shape[0] // self.world_size) * math.prod(p.param.shape[1:]) for p in sharded)
        self.flat = torch.zeros(size, dtype=self.dtype, device=self.device)
        self.sharded: list[ShardedParam] = []
        offset = 0
        for plan_param in sharded:
            entry = ShardedParam(plan_param, offset, self.world_size, self.rank, self.flat, self.compute_dtype)
            self.sharded.append(entry)
            offset += entry.padded
        self.grad_numel = sum(e.padded for e in self.sharded if e.requires_grad)
        self.replicated: list[ReplicatedParam] = []
        offset = 0
        for plan_param in (p for p in plan.params if not p.sharded):
            self.replicated.append(ReplicatedParam(plan_param, offset, compute_dtype))
            if plan_param.param.requires_grad:
                offset += plan_param.param.numel()
        self.replicated_grad_numel = offset
        self.needed_in_backward = plan.needed_in_backward
        self.gathered_bytes = sum(math.prod(e.shape) for e in self.sharded) * torch.empty(
            (), dtype=self.compute_dtype).element_size()
        self.gathered = False
        self.pending = None          # (future, stamp, output buffer) of an all-gather in flight
        self.packed = self.replicated_acc = None  # gradients folded since the last reduction
        self.reducing = None         # (sharded future, its stamp, packed, replicated future, its stamp, flat)
        self.pending_backward = 0    # forward calls whose backward has not finished (FSDP resets per forward)
        self.backward_gathered = self.backward_done = False
        self._use(local=True)

    # --- gather / reshard ----------------------------------------------------------------------------

    def _use(self, local: bool) -> None:
        """Point every slot at the local shards (at rest) or at the full parameters (gathered)."""
        for entry in self.sharded:
            for slot in entry.slots:
                slot.module._parameters[slot.attr] = entry.local if local else entry.full
        for entry in self.replicated:
            if entry.cast:
                for slot in entry.slots:
                    slot.module._parameters[slot.attr] = entry.param if local else entry.full

    def launch_gather(self, on_cuda: bool):
        """Start the all-gather; returns its stamp (None when nothing to gather or already under way)."""
        if self.gathered or self.pending is not None or not self.sharded:
            return None
        out = torch.empty(self.world_size * self.flat.numel(), dtype=self.compute_dtype, device=self.device)
        source = self.flat if self.compute_dtype == self.dtype else self.flat.to(self.compute_dtype)

        def launch():
            return [all_gather(out, source, group=self.group, async_op=True, implementation=self.collectives)]
        future, stamp = launch_stamped(launch, tensor_bytes(out), on_cuda)
        self.pending = (future, stamp, out)
        return stamp

    @torch.no_grad()
    def wait_gathered(self) -> None:
        """Wait for the all-gather (launched by the caller), fill the full parameters, point the modules at them."""
        if self.gathered:
            return
        if self.pending is not None:
            future, _, out = self.pending
            future.wait()
            self.pending = None
            gathered = out.view(self.world_size, -1)
            for entry in self.sharded:
                _allocate(entry.full_data)
                entry.copy_out(gathered, entry.full_data)
        for entry in self.replicated:
            if entry.cast:
                _allocate(entry.full_data)
                entry.full_data.copy_(entry.param.detach())
        self.gathered = True
        self._use(local=False)

    def reshard(self) -> None:
        if not self.gathered:
            return
        self._use(local=True)
        for entry in self.sharded:
            _free(entry.full_data)
        for entry in self.replicated:
            if entry.cast:
                _free(entry.full_data)
        self.gathered = False

    # --- gradients -----------------------------------------------------------------------------------

    @torch.no_grad()
    def fold_grads(self) -> None:
        """Move the full gradients (divided by N) into this unit's reduction buffers, drop them."""
        first = self.packed is None
        scale = self.scale
        if first:
            self.packed = torch.empty(self.world_size, self.grad_numel, dtype=self.dtype, device=self.device)
            self.replicated_acc = torch.empty(self.replicated_grad_numel, dtype=self.dtype, device=self.device)
        for entry in self.sharded:
            if entry.requires_grad:
                entry.fold_grad(self.packed, entry.full.grad, scale, first)
                entry.full.grad = None
        for entry in self.replicated:
            if not entry.param.requires_grad:
                continue
            dst = self.replicated_acc[entry.offset:entry.offset + entry.param.numel()].view_as(entry.param)
            grad = entry.full.grad
            if grad is None:
                if first:
                    dst.zero_()
            elif first:
                scaled_into(dst, grad, scale)
            else:
                dst.add_(grad, alpha=scale)
            entry.full.grad = None

    def has_grads(self) -> bool:
        return self.grad_numel + self.replicated_grad_numel > 0

    def launch_reduce(self, on_cuda: bool) -> list:
        """Sum every rank's folded gradients: row r of the sharded buffer onto rank r, the replicated
        buffer onto every rank, in the wire dtype when one is set (a cast copy of the fp32 buffers).
        Returns the stamps."""
        if self.packed is None:
            return []
        packed, flat = (self._to_wire(t) for t in (self.packed, self.replicated_acc))
        self.packed = self.replicated_acc = None
        stamps, sharded = [], (None, None, None)
        if self.grad_numel:
            shard = torch.empty(self.grad_numel, dtype=packed.dtype, device=self.device)

            def launch():
                return [reduce_scatter(shard, packed.view(-1), group=self.group, async_op=True,
                                       implementation=self.collectives)]
            future, stamp = launch_stamped(launch, tensor_bytes(packed), on_cuda)
            sharded = (future, stamp, shard)
            stamps.append(stamp)
        replicated = (None, None)
        if self.replicated_grad_numel:
            future, stamp = launch_stamped(lambda: [dist.all_reduce(flat, group=self.data_group, async_op=True)],
                                           tensor_bytes(flat), on_cuda)
            replicated = (future, stamp)
            stamps.append(stamp)
        self.reducing = (*sharded, *replicated, flat)
        return stamps

    def _to_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.wire_dtype in (None, tensor.dtype) else tensor.to(self.wire_dtype)

    @torch.no_grad()
    def assign_grads(self, on_cuda: bool = False) -> list:
        """Wait for the reduction; each local parameter's `.grad` gets its averaged part (its own shape,
        the master dtype), added to one already there. With replicas, the shard is all-reduced across
        them first (its stamp is returned)."""
        if self.reducing is None:
            return []
        future, _, mine, rep_future, _, flat = self.reducing
        self.reducing, stamps = None, []
        if future is not None:
            future.wait()
            if self.replicas is not None:  # hsdp: the same shard from every shard group, summed
                across, stamp = launch_stamped(lambda: [dist.all_reduce(mine, group=self.replicas, async_op=True)],
                                               tensor_bytes(mine), on_cuda)
                across.wait()
                stamps.append(stamp)
            shard = mine.to(self.dtype)
            for entry in self.sharded:
                if entry.requires_grad:
                    grad = shard[entry.offset:entry.offset + entry.local.numel()].view_as(entry.local)
                    _accumulate(entry.local, grad)
        if rep_future is not None:
            rep_future.wait()
            flat = flat.to(self.dtype)
            for entry in self.replicated:
                if entry.param.requires_grad:
                    p = entry.param
                    grad = flat[entry.offset:entry.offset + p.numel()].view_as(p)
                    if entry.cast:
                        _accumulate(p, grad)
                    else:
                        p.grad = grad  # autograd already added any earlier .grad into what was reduced
        return stamps

    def gather_full(self) -> dict[str, torch.Tensor]:
        """Every sharded parameter at full size in the master dtype (blocking; not counted in `comm`)."""
        if not self.sharded:
            return {}
        out = torch.empty(self.world_size * self.flat.numel(), dtype=self.dtype, device=self.device)
        all_gather(out, self.flat, group=self.group, implementation=self.collectives)
        gathered = out.view(self.world_size, -1)
        result = {}
        for entry in self.sharded:
            result[entry.name] = torch.empty(entry.shape, dtype=self.dtype, device=self.device)
            entry.copy_out(gathered, result[entry.name])
        return result


def scaled_into(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """dst = src * scale, computed in dst's dtype (a narrower src is widened first)."""
    if src.dtype == dst.dtype:
        torch.mul(src, scale, out=dst)
    else:
        dst.copy_(src)
        dst.mul_(scale)


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
