"""`strategy=fsdp_torch`: torch's `fully_shard` (FSDP2) on fsdp's units with fsdp's knobs: the bar for fsdp.

`comm_dtype` (bf16, fp16) is FSDP2's `MixedPrecisionPolicy(reduce_dtype=...)`: gradients are
reduce-scattered in that dtype and land in the fp32 gradient shards, as fsdp's comm_dtype does.

The units are fsdp's (`plan_units` with the default policy: each Transformer block, the embedding,
the output head), each wrapped by `fully_shard` on a 1-D device mesh of every rank, then the whole
model (the root: the parameters in no unit). Knobs as fsdp's: `reshard_after_forward` (the last
unit of the forward is not resharded, as fsdp keeps it and torchtitan does), and `compute_dtype`
as `MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=float32)`: parameters gathered
and used in the compute dtype, gradients reduced and kept in fp32 with fp32 shards, as fsdp. FSDP2
shards every parameter of a unit over dim 0 (it has no per-parameter replicate), so norm weights
are sharded here where fsdp's default policy replicates them.

Prefetch as fsdp does it: each unit prefetches the next in forward and the previous in backward
(`set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`) with async all-gathers
(`_set_unshard_async_op(True)`: on CPU FSDP2 otherwise gathers synchronously, as it relies on
CUDA streams for overlap). The embedding is not gathered again for backward
(`set_unshard_in_backward(False)`: its backward needs only the indices), as fsdp does not either.

The wrapper contract: `no_sync()` is FSDP2's `set_requires_gradient_sync(False)`; gradients are
reduce-scattered inside backward (FSDP2's post-backward), so `finish_gradient_synchronization()`
only records the communication. `comm` figures are measured, not estimated: every all-gather and
reduce-scatter FSDP2 issues goes through counting subclasses of its default collectives
(`set_custom_all_gather` / `set_custom_reduce_scatter`), which run the collectives
`backend.collectives` chooses (strategies/collectives.py: on gloo the lab's rings, as fsdp's, so the
bar runs on the same collectives; `native`: torch's own calls), add the bytes and calls it really
moved, and time each from launch to completion (async all-gathers: by their future's callback; on
CUDA by events on the stream FSDP2 issues from and on the collective's stream, never a host
synchronization). Waits count as fsdp's do (`CommStats.waited`): FSDP2's wait for an all-gather
before a unit's forward or backward (the work it gets back is wrapped to time its `wait()`) and
its blocking reduce-scatter inside backward are exposed communication on CPU, where the host
waits; on CUDA they order streams, as fsdp's waits do, and are not host waits. `peak_gathered_bytes` is
fsdp's: the most gathered parameter bytes held at once, each unit's all-gather output counted from its launch
while FSDP2 holds the unit unsharded.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.spec.strategies.fsdp_units import plan_units
from ddp_lab.strategies.base import DataParallelBase, compile_units
from ddp_lab.strategies.collectives import all_gather, collectives_in_use, reduce_scatter
from ddp_lab.strategies.comm_stats import CommStats, Stamp, begin_stamp, close_stamps, end_blocking, end_when_done
from ddp_lab.strategies.fsdp.wrapper import resolve_compute_dtype
from ddp_lab.strategies.rings import work_from_future
from ddp_lab.units import tensor_bytes


class CountedWait(dist.distributed_c10d.Work):
    """An all-gather's work whose `wait()` (FSDP2's, before the unit's forward or backward) is a
    wait for communication: exposed on CPU, where the host waits; on CUDA a stream order, as fsdp's.
    `gathered()` is called after it: FSDP2 holds the unit's parameters gathered from then on."""

    def __init__(self, work, comm: CommStats, gathered):
        super().__init__()
        self.work, self.comm, self.gathered = work, comm, gathered

    def wait(self, timeout=None):
        with self.comm.waited():
            done = self.work.wait() if timeout is None else self.work.wait(timeout)
        self.gathered()
        return done

    def get_future(self):
        return self.work.get_future()

    def is_completed(self):
        return self.work.is_completed()


def counted_collectives():
    """FSDP2's default all-gather and reduce-scatter, subclassed to record what they move (imported
    here, not at module level: torch's FSDP2 and DTensor add a second to every rank's start), and the
    all-gather's work wrapped so that FSDP2's wait for it counts as fsdp's does (`CommStats.waited`)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class CountedAllGather(DefaultAllGather):
        """FSDP2's all-gather of one unit on the chosen collectives, its bytes (the gathered output) and interval
        recorded; `gathered(self)` called as it launches (its output exists from then on) and after its wait."""

        gathered_bytes = 0
        """The unit's gathered parameters, as its last all-gather's output (0 before its first)."""

        def __init__(self, stamps: list[Stamp], comm: CommStats, collectives: str, gathered):
            self.stamps, self.comm, self.collectives, self.gathered = stamps, comm, collectives, gathered

        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
            on_cuda = output_tensor.is_cuda
            self.gathered_bytes = tensor_bytes(output_tensor)
            self.gathered(self)
            stamp = begin_stamp(self.gathered_bytes, on_cuda)
            self.stamps.append(stamp)
            work = all_gather(output_tensor, input_tensor, group=group, async_op=async_op,
                              implementation=self.collectives)
            if work is None:
                end_blocking(stamp, on_cuda)
                return work
            end_when_done(stamp, work, on_cuda)
            return CountedWait(work, self.comm, self.gathered)

    class CountedReduceScatter(DefaultReduceScatter):
        """FSDP2's reduce-scatter on the chosen collectives, its bytes (the reduced input) and interval
        recorded; FSDP2 issues it blocking inside backward: on CPU the host waits, exposed communication
        (`CommStats.waited`)."""

        def __init__(self, stamps: list[Stamp], comm: CommStats, collectives: str):
            self.stamps, self.comm, self.collectives = stamps, comm, collectives

        def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
            on_cuda = input_tensor.is_cuda
            stamp = begin_stamp(tensor_bytes(input_tensor), on_cuda)
            self.stamps.append(stamp)
            if async_op:
                work = self.run(output_tensor, input_tensor, group, op, async_op)
                end_when_done(stamp, work, on_cuda)
                return work
            with self.comm.waited():
                work = self.run(output_tensor, input_tensor, group, op, async_op)
            end_blocking(stamp, on_cuda)
            return work

        def run(self, output_tensor, input_tensor, group, op, async_op: bool):
            if self.collectives == "native":  # FSDP2's own call, with its op (AVG on nccl)
                return super().__call__(output_tensor, input_tensor, group, op, async_op)
            if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                raise ValueError(f"the lab's ring reduce-scatter sums or averages; FSDP2 asked for {op}")
            work = reduce_scatter(output_tensor, input_tensor, group=group, async_op=async_op, implementation="ring")
            if op != dist.ReduceOp.AVG:
                return work
            n = dist.get_world_size(group)  # AVG (FSDP2's choice on gloo too): the ring's sum, divided
            if work is None:
                output_tensor.div_(n)
                return None
            return work_from_future(work.get_future().then(lambda _: output_tensor.div_(n)))

    return CountedAllGather, CountedReduceScatter


class FSDP2Strategy(DataParallelBase):
    """What fsdp_torch and replicate_torch share, both built on FSDP2's machinery: gradients reduced in its
    post-backward hooks, outside `no_sync()`, or under a pipeline once after the schedule; `stamps` of what it
    issued; compiled unit by unit; DTensor parameters made whole for `full_state_dict()`."""

    reduces_after_no_sync = False  # FSDP2's: in backward hooks, or under a pipeline after it (base.py)

    stamps: list
    _units: list

    pipelined = False
    """Under a pipeline (`before_pipeline_step`): every backward of the step accumulates with gradient sync off, and
    one reduction a unit follows the schedule (`finish_gradient_synchronization`), as torch's PipelineStage runs an
    FSDP2 module: reducing inside the last backward would hold the input's gradient the previous stage waits for
    behind this stage's collectives (blocking on CPU)."""

    def before_pipeline_step(self) -> None:
        self.pipelined = True
        sync_off_for_the_step(self.module)

    def no_sync(self):
        return nullcontext() if self.pipelined else GradientSyncOff(self.module)

    def finish_gradient_synchronization(self) -> None:
        with self.comm.exposed():
            if self.pipelined:
                reduce_after_backward(self.module)
            close_stamps(self.stamps, self.comm)

    def compile_model(self, backend: str) -> None:
        """`train.compile` per unit, as torchtitan compiles FSDP2's blocks (`compile_units`): each unit's own forward,
        FSDP2's hooks around it eager, so each unit's reduction still starts when its backward is done."""
        compile_units(self.module, backend, self._units)

    def full_state_dict(self) -> dict:
        return full_dtensor_state(self.module)


class TorchFSDP(FSDP2Strategy):
    """torch's FSDP2 behind the strategy contract (module docstring)."""

    collectives: str | None = None
    """ring or native (strategies/collectives.py); None: what `backend.collectives` chose, read when built."""

    def __init__(self, module: nn.Module, compute_dtype=None, reshard_after_forward: bool = True,
                 comm_dtype=None, shard_size: int | None = None, process_group=None):
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        compute_dtype = resolve_compute_dtype(compute_dtype)
        wire = resolve_compute_dtype(comm_dtype, "comm_dtype")  # fsdp's names: fp32 (as is), bf16, fp16
        plans = [plan for plan in plan_units(module) if plan.module is not None]
        units = [plan.module for plan in plans]
        if process_group is not None and shard_size is not None:
            raise ValueError("fsdp_torch: shard_size (hybrid sharding) lays its mesh over every rank, not a mesh's "
                             "data-parallel axis")
        # fully_shard shards each rank's own weights: start from the first rank's
        super().__init__(module, process_group=process_group)
        self.compute_dtype, self.reshard_after_forward = compute_dtype, reshard_after_forward
        self.comm_dtype = str(comm_dtype or "fp32")
        device = next(module.parameters()).device
        world = self.dp_size
        self.shard_size = shard_size or world
        if process_group is not None:  # a mesh's data-parallel axis: FSDP2 on it, as torchtitan applies it
            mesh = DeviceMesh.from_group(process_group, device.type, mesh_dim_names=("dp",))
        elif self.shard_size == world:
            mesh = init_device_mesh(device.type, (world,))
        else:  # hybrid: replicate x shard
            mesh = init_device_mesh(device.type, (world // self.shard_size, self.shard_size),
                                    mesh_dim_names=("replicate", "shard"))
        reduce_dtype = wire or (torch.float32 if compute_dtype else None)
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
        for i, unit in enumerate(units):
            fully_shard(unit, mesh=mesh, mp_policy=policy,
                        reshard_after_forward=reshard_after_forward and i < len(units) - 1)
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        for earlier, later in zip(units, units[1:]):
            earlier.set_modules_to_forward_prefetch([later])
            later.set_modules_to_backward_prefetch([earlier])
        self.stamps: list[Stamp] = []
        self.collectives = self.collectives or collectives_in_use(process_group)
        CountedAllGather, CountedReduceScatter = counted_collectives()
        self.peak_gathered_bytes = 0 if self.dp_size > 1 else None  # at one rank FSDP2 gathers nothing (it copies)
        self._gathers = []  # (FSDP2 module, its counted all-gather): what `_note_gathered` sums
        for fsdp_module in [*units, module]:
            fsdp_module._set_unshard_async_op(True)
            gather = CountedAllGather(self.stamps, self.comm, self.collectives, self._note_gathered)
            fsdp_module.set_custom_all_gather(gather)
            fsdp_module.set_custom_reduce_scatter(CountedReduceScatter(self.stamps, self.comm, self.collectives))
            self._gathers.append((fsdp_module, gather))
        for plan in plans:
            if not plan.needed_in_backward:  # fsdp's rule (spec/strategies/fsdp_units.py): a unit of embeddings only
                plan.module.set_unshard_in_backward(False)
        self._units = units

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        if self.pipelined:
            self._note_unsharded()
        super().finish_gradient_synchronization()

    def _note_unsharded(self) -> None:
        """What FSDP2 holds whole beside its shards at a pipeline's peak, just before its one reduction
        (`unsharded_bytes`): every unit's gathered parameters, kept through the micro-batches, and the gradients
        accumulated whole over them."""
        held = 0
        for fsdp_module, gather in self._gathers:
            groups = fsdp_module._get_fsdp_state()._fsdp_param_groups
            if any(g.is_unsharded for g in groups):
                held += gather.gathered_bytes
            for param in (p for g in groups for p in g.fsdp_params):
                grad = param.unsharded_accumulated_grad  # kept apart where the reduce dtype differs
                if grad is None:
                    unsharded = getattr(param, "_unsharded_param", None)
                    grad = None if unsharded is None else unsharded.grad
                held += 0 if grad is None else tensor_bytes(grad)
        self.unsharded_bytes = max(self.unsharded_bytes or 0, held)

    def _note_gathered(self, launching=None) -> None:
        """The high-water mark of gathered parameters, as fsdp's (`peak_gathered_bytes`): every unit FSDP2 holds
        unsharded or has an all-gather in flight for, and `launching`'s, whose output exists from its launch."""
        held = 0
        for fsdp_module, gather in self._gathers:
            groups = fsdp_module._get_fsdp_state()._fsdp_param_groups
            if gather is launching or any(g.is_unsharded or g._all_gather_result is not None for g in groups):
                held += gather.gathered_bytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, held)

    def before_pipeline_step(self) -> None:
        """Every unit's gather issued at once as the step begins (FSDP2's `unshard(async_op=True)`, which each
        unit's forward waits for), so a later stage's gathers run while it waits for its first activation, and kept
        through every micro-batch; the first step gathers as its forwards come (FSDP2 sets itself up there)."""
        if self.pipelined:
            for unit in [*self._units, self.module]:
                unit.unshard(async_op=True)
        else:
            self.module.set_reshard_after_forward(False)
        super().before_pipeline_step()

    def facts(self) -> dict:
        uncounted = self.shard_size < self.dp_size  # FSDP2 all-reduces across replicas itself
        # At one rank FSDP2 issues no collective at all: it copies the shard into the unsharded parameter and
        # the gradient into the shard (torch's _fsdp_param_group.py / _fsdp_collectives.py, `world_size == 1`).
        figures = ("none: at one rank FSDP2 issues no collective (it copies), so comm_ms is a true 0"
                   if self.dp_size == 1 else
                   "measured" + (", without the all-reduce across shard groups" if uncounted else ""))
        return {"fsdp_torch": {"units": len(self._units), "shard_size": self.shard_size,
                               "comm_figures": figures,
                               "compute_dtype": str(self.compute_dtype or "parameters'").replace("torch.", ""),
                               "reshard_after_forward": self.reshard_after_forward}}

def full_dtensor_state(module: nn.Module) -> dict:
    """An FSDP2-managed module's state dict with every DTensor made whole (collective: every rank calls
    it): fsdp_torch's and replicate_torch's full_state_dict."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v.detach().clone()
            for k, v in module.state_dict().items()}


def sync_off_for_the_step(module) -> None:
    """FSDP2 (fully_shard or replicate()) told that every backward until `reduce_after_backward` accumulates: no
    reduction, no reshard, no end-of-backward wait, as torch's PipelineStage sets it for each backward."""
    module.set_is_last_backward(False)
    module.set_reshard_after_backward(False)
    module.set_requires_gradient_sync(False)


def reduce_after_backward(module) -> None:
    """FSDP2's post-backward, run by hand after backwards that all ran with gradient sync off (the unsharded
    gradients accumulated): each parameter group's reduce-scatter and reshard, then the root's end-of-backward
    callback, as torch's pipelining does it (`_PipelineStageBase.perform_reduce_grad`)."""
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = module._get_fsdp_state()
    for unit_state in state._state_ctx.all_states:
        for group in unit_state._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


class GradientSyncOff:
    """FSDP2's way to skip gradient reduction for accumulation (fully_shard's and replicate()'s no_sync),
    restored on exit."""

    def __init__(self, module):
        self.module = module

    def __enter__(self):
        self.module.set_requires_gradient_sync(False)

    def __exit__(self, *exc):
        self.module.set_requires_gradient_sync(True)
