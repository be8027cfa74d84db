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
(`set_custom_all_gather` / `set_custom_reduce_scatter`), which add the bytes and calls it really
moved, and time each from launch to completion (async all-gathers: by their future's callback;
FSDP2 issues the reduce-scatter blocking, so its whole duration is also exposed communication).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.strategies.base import DataParallelBase
from ddp_lab.strategies.comm_stats import CommStats, Stamp, record_intervals
from ddp_lab.strategies.fsdp.policy import plan_units
from ddp_lab.strategies.fsdp.wrapper import resolve_compute_dtype
from ddp_lab.units import tensor_bytes


def _stamped(stamps: list[Stamp], work, nbytes: int, start: float) -> None:
    """Record an async collective launched at `start`; its future's callback sets the end."""
    stamp = Stamp(nbytes)
    stamp.start = start
    stamps.append(stamp)
    try:
        work.get_future().then(lambda fut: setattr(stamp, "end", time.perf_counter()))
    except RuntimeError:  # a work with no future: its end is taken when the step's figures are
        pass


def counted_collectives():
    """FSDP2's default all-gather and reduce-scatter, subclassed to record what they move (imported
    here, not at module level: torch's FSDP2 and DTensor add a second to every rank's start)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class CountedAllGather(DefaultAllGather):
        """FSDP2's all-gather, its bytes (the gathered output) and interval recorded."""

        def __init__(self, stamps: list[Stamp]):
            self.stamps = stamps

        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
            start = time.perf_counter()
            work = super().__call__(output_tensor, input_tensor, group, async_op)
            if work is not None:
                _stamped(self.stamps, work, tensor_bytes(output_tensor), start)
            else:
                stamp = Stamp(tensor_bytes(output_tensor))
                stamp.start, stamp.end = start, time.perf_counter()
                self.stamps.append(stamp)
            return work

    class CountedReduceScatter(DefaultReduceScatter):
        """FSDP2's reduce-scatter, its bytes (the reduced input) and interval recorded; a blocking one is
        exposed communication."""

        def __init__(self, stamps: list[Stamp], comm: CommStats):
            self.stamps, self.comm = stamps, comm

        def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
            stamp = Stamp(tensor_bytes(input_tensor))
            stamp.start = time.perf_counter()
            if async_op:
                work = super().__call__(output_tensor, input_tensor, group, op, async_op)
                _stamped(self.stamps, work, stamp.nbytes, stamp.start)
                return work
            with self.comm.exposed():
                work = super().__call__(output_tensor, input_tensor, group, op, async_op)
            stamp.end = time.perf_counter()
            self.stamps.append(stamp)
            return work

    return CountedAllGather, CountedReduceScatter


class TorchFSDP(DataParallelBase):
    """torch's FSDP2 behind the strategy contract (module docstring)."""

    name = "fsdp_torch"
    zero_stage = 3

    def __init__(self, module: nn.Module, compute_dtype=None, reshard_after_forward: bool = True,
                 comm_dtype=None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        compute_dtype = resolve_compute_dtype(compute_dtype)
        wire = resolve_compute_dtype(comm_dtype, "comm_dtype")  # fsdp's names: fp32 (as is), bf16, fp16
        units = [plan.module for plan in plan_units(module) if plan.module is not None]
        super().__init__(module)  # fully_shard shards each rank's own weights: start from rank 0's
        self.compute_dtype, self.reshard_after_forward = compute_dtype, reshard_after_forward
        self.comm_dtype = str(comm_dtype or "fp32")
        device = next(module.parameters()).device
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        reduce_dtype = wire or (torch.float32 if compute_dtype else None)
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
        for i, unit in enumerate(units):
            fully_shard(unit, mesh=mesh, mp_policy=policy,
                        reshard_after_forward=reshard_after_forward and i < len(units) - 1)
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        for earlier, later in zip(units, units[1:]):
            earlier.set_modules_to_forward_prefetch([later])
            later.set_modules_to_backward_prefetch([earlier])
        self._stamps: list[Stamp] = []
        CountedAllGather, CountedReduceScatter = counted_collectives()
        for fsdp_module in [*units, module]:
            fsdp_module._set_unshard_async_op(True)
            fsdp_module.set_custom_all_gather(CountedAllGather(self._stamps))
            fsdp_module.set_custom_reduce_scatter(CountedReduceScatter(self._stamps, self.comm))
        for unit in units:
            if all(isinstance(m, nn.Embedding) for m in unit.modules() if list(m.parameters(recurse=False))):
                unit.set_unshard_in_backward(False)
        self._units = units

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        return _NoSync(self.module)

    def finish_gradient_synchronization(self) -> None:
        with self.comm.exposed():
            now = time.perf_counter()
            for stamp in self._stamps:
                stamp.end = stamp.end if stamp.end is not None else now
            record_intervals(self._stamps, self.comm)
            self._stamps.clear()

    def facts(self) -> dict:
        return {"fsdp_torch": {"units": len(self._units), "comm_figures": "measured",
                               "compute_dtype": str(self.compute_dtype or "parameters'").replace("torch.", ""),
                               "reshard_after_forward": self.reshard_after_forward}}

    def full_state_dict(self) -> dict:
        """Every DTensor made whole (collective: every rank calls it)."""
        from torch.distributed.tensor import DTensor

        return {k: v.full_tensor() if isinstance(v, DTensor) else v.detach().clone()
                for k, v in self.module.state_dict().items()}


class _NoSync:
    """FSDP2's way to skip gradient reduction for accumulation, restored on exit."""

    def __init__(self, module):
        self.module = module

    def __enter__(self):
        self.module.set_requires_gradient_sync(False)

    def __exit__(self, *exc):
        self.module.set_requires_gradient_sync(True)
