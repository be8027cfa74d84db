"""TorchDDP: torch's own DistributedDataParallel behind our wrapper contract, the in-run reference.

So every sweep can include the production implementation next to ours, measured the same way.

- `bucket_mb` is DDP's `bucket_cap_mb` (DDP also keeps its 1 MiB first bucket and rebuilds the
  buckets after the first iteration from the real gradient order).
- `gradient_as_bucket_view` is DDP's: the gradients are views into DDP's flat buckets, as
  BucketedDDP's are into its own, instead of a second copy of them (the memory accounting counts the
  buckets as strategy state either way; docs/benchmarks.md measures both).
- `.module` is the user's model, as for every wrapper; the DDP object is `.ddp` and is kept out of
  the module tree so `parameters()` and `state_dict()` are the model's own.
- `forward_sync_buffers=False` (`broadcast_buffers=False` on older torch): our strategies do not
  re-broadcast buffers every forward either (the models here have no buffers that training
  changes); the start-up broadcast of parameters and buffers is ours (DDP's `init_sync=False`).
- Forwards in eval mode or under no_grad bypass DDP, so they never arm its reducer (DDP's forward
  can issue collectives, and evaluation is often done by some ranks only).
- Comm accounting: an all-reduce comm hook (the same divide-then-sum as DDP's default) stamps each
  bucket's in-flight interval as for our strategies (collectives.py), so `comm_ms` is comparable.
- `comm_dtype`: fp16 runs torch's own `fp16_compress_hook` (cast, divide, all-reduce, copy back)
  inside the stamping hook; bf16 runs torch's `bf16_compress_hook`, which torch allows only with
  CUDA and NCCL 2.10+ (a name check in `register_comm_hook`), so launcher/config_checks.py refuses bf16
  on gloo before any rank starts. torch's hooks cast *before* dividing: an fp32 gradient above
  fp16's maximum (65504) becomes inf there, where ours (collectives.py) divide first.
- `measure.per_collective=false` makes this the bare DDP row: no comm hook and no hook on any parameter (torch's
  own C++ all-reduce, or its compression hook as it is), so a sweep shows what the lab's instrumentation of
  DDP costs. Its collectives are then neither counted nor timed (DDP issues them unseen); only the wait
  `finish_gradient_synchronization()` sees is exposed (none: DDP waits inside backward).
- A backward DDP did not arm (a forward in eval mode or under no_grad, or inside `no_sync()`) leaves its
  gradients unreduced: `finish_gradient_synchronization()` sees that no armed forward preceded it and
  all-reduces them itself, so the contract holds either way.
- Exposed comm: DDP waits for its buckets inside `backward()`, so there is nothing left to time in
  `finish_gradient_synchronization()`. Exposed is instead measured from the last gradient
  accumulated (a post-accumulate-grad hook on every trainable parameter; a CUDA event on GPU) to
  the call of `finish_gradient_synchronization()`, which the trainer makes right after backward:
  the wait for the last buckets plus DDP's copy of the averaged buckets back into `.grad`.
"""

from __future__ import annotations

import inspect
import time
import weakref
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ddp_lab.arithmetic.buckets import DEFAULT_BUCKET_MB
from ddp_lab.rank.process_group import synchronize
from ddp_lab.strategies.base import DataParallelBase
from ddp_lab.strategies.collectives import (
    WIRE_DTYPES,
    all_reduce_mean_async,
    flat_all_reduce_mean_,
    launch_stamped,
)
from ddp_lab.strategies.comm_stats import host_time_of, per_collective, record_intervals
from ddp_lab.units import MiB, tensor_bytes

_DDP_ARGS = inspect.signature(DistributedDataParallel.__init__).parameters


class _HookState:
    """What the comm hooks share with the wrapper: the stamps of this step's buckets, the wire dtype,
    and DDP's bucket buffers by index (kept state for the memory accounting: with
    `gradient_as_bucket_view` off they are a second copy of the gradients)."""

    def __init__(self, comm_dtype: str, process_group=None):
        self.stamps: list = []
        self.comm_dtype = comm_dtype
        self.process_group = process_group
        self.buckets: dict[int, torch.Tensor] = {}


def _keep(state: _HookState, bucket) -> torch.Tensor:
    """Remember the bucket's buffer; bucket 0 comes first in every step, and after DDP's rebuild (at
    the second step) the old buckets are gone: start the step's list afresh there."""
    if bucket.index() == 0:
        state.buckets.clear()
    buffer = state.buckets[bucket.index()] = bucket.buffer()
    return buffer


def _timed_all_reduce_hook(state, bucket):
    # No annotations: DDP checks them and this module's are strings (`from __future__`).
    _keep(state, bucket)
    future, stamp = all_reduce_mean_async(bucket.buffer(), group=state.process_group)
    state.stamps.append(stamp)
    return future


# comm_dtype -> torch's own compression hook.
TORCH_COMPRESS_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def _timed_compress_hook(state, bucket):
    """torch's compression hook for the bucket, its in-flight interval stamped; bytes in the wire dtype."""
    buffer = _keep(state, bucket)
    nbytes = buffer.numel() * torch.empty((), dtype=WIRE_DTYPES[state.comm_dtype]).element_size()
    future, stamp = launch_stamped(lambda: [TORCH_COMPRESS_HOOKS[state.comm_dtype](state.process_group, bucket)],
                                   nbytes, buffer.is_cuda)
    state.stamps.append(stamp)
    return future


class TorchDDP(DataParallelBase):
    def __init__(self, module: nn.Module, bucket_mb: float = DEFAULT_BUCKET_MB, comm_dtype: str = "fp32",
                 gradient_as_bucket_view: bool = True, process_group=None, **ddp_kwargs):
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be a number > 0, got {bucket_mb!r}")
        # broadcasts parameters and buffers from the group's first rank, frozen ones too
        super().__init__(module, comm_dtype, process_group=process_group)
        # Newer torch renamed `broadcast_buffers` (and warns on the old name); same meaning here.
        buffers_key = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers"
        ddp_kwargs.setdefault(buffers_key, False)
        ddp = DistributedDataParallel(module, bucket_cap_mb=bucket_mb, init_sync=False, process_group=process_group,
                                      gradient_as_bucket_view=gradient_as_bucket_view, **ddp_kwargs)
        self._hook_state = _HookState(self.comm_dtype, process_group)
        self._stamps = self._hook_state.stamps  # the same list object DDP's hook appends to
        compress = self.comm_dtype in TORCH_COMPRESS_HOOKS
        self.bare = not per_collective()  # measure.per_collective=false: torch's DDP with none of the lab's hooks
        if not self.bare:
            ddp.register_comm_hook(self._hook_state, _timed_compress_hook if compress else _timed_all_reduce_hook)
        elif compress:
            ddp.register_comm_hook(process_group, TORCH_COMPRESS_HOOKS[self.comm_dtype])
        object.__setattr__(self, "ddp", ddp)  # not a submodule: see the module docstring
        self.bucket_mb, self.gradient_as_bucket_view = bucket_mb, gradient_as_bucket_view
        self._last_grad = None
        self._armed = False  # the last training forward went through DDP outside no_sync(): DDP reduces
        if self.bare:
            self.comm.sees_collectives = False
            return
        # The hook holds this wrapper weakly: a bound method would close the cycle parameter -> hook ->
        # wrapper -> DDP -> reducer (C++, unseen by the garbage collector) -> parameter, and keep DDP
        # and its process group alive past destroy_process_group() into interpreter teardown.
        this = weakref.ref(self)

        def mark_grad(param: torch.Tensor) -> None:
            wrapper = this()
            if wrapper is not None:
                wrapper._mark_grad(param)

        for param in self.trainable_parameters():
            param.register_post_accumulate_grad_hook(mark_grad)

    def _mark_grad(self, param: torch.Tensor) -> None:
        if param.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._last_grad = event
        else:
            self._last_grad = time.perf_counter()

    def compile_model(self, backend: str) -> None:
        """As torch documents DDP with torch.compile: the DDP-wrapped model compiled, so its DDPOptimizer splits the
        graph at bucket boundaries and the buckets' all-reduces can still start during backward."""
        self.ddp.compile(backend=backend)

    @property
    def bucket_sizes_mb(self) -> list[float]:
        """DDP's current buckets in MiB, launch order. They change once, at the second forward.

        Unlike BucketedDDP's, a DDP bucket may pass the cap by one tensor (DDP closes a bucket once
        it reaches the cap), and the first bucket's cap is 1 MiB until the rebuild.
        """
        try:
            buckets = self.ddp.reducer._get_zeros_like_grad_buckets()  # private: torch may drop it
            return [tensor_bytes(b.buffer()) / MiB for b in buckets]
        except (AttributeError, RuntimeError):
            sizes = self.ddp._get_ddp_logging_data().get("bucket_sizes", "")  # the initial plan
            return [int(s) / MiB for s in str(sizes).split(",") if s.strip()]

    def facts(self) -> dict:
        facts = {"buckets": {"count": len(self.bucket_sizes_mb), "sizes_mb": list(self.bucket_sizes_mb)}}
        if self.bare:
            facts["bare"] = "torch's DDP with none of the lab's hooks (measure.per_collective=false): no comm figures"
        return facts

    def kept_tensors(self) -> list[torch.Tensor]:
        """DDP's bucket buffers, as its comm hook last saw them (from the first synchronized step on).
        With `gradient_as_bucket_view` the gradients are views into them, so they add nothing."""
        return list(self._hook_state.buckets.values())

    def forward(self, *args, **kwargs):
        if self.training and torch.is_grad_enabled():
            self._armed = self.require_sync
            return self.ddp(*args, **kwargs)
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        with super().no_sync(), self.ddp.no_sync():
            yield

    def finish_gradient_synchronization(self) -> None:
        stamps = self._stamps[:]
        self._stamps.clear()  # the same list object DDP's hook appends to
        armed, self._armed = self._armed, False
        if not armed and any(p.grad is not None for p in self.trainable_parameters()):
            self._last_grad = None
            with self.comm.exposed():
                # Gradients from a backward DDP did not arm: one flat all-reduce, as FlatDDP does.
                flat_all_reduce_mean_([p.grad for p in self.trainable_parameters() if p.grad is not None], self.comm,
                                      self.wire_dtype, group=self.process_group)
            return
        if stamps and self._last_grad is not None:
            synchronize(self.comm.device)
            now = time.perf_counter()
            last = self._last_grad if isinstance(self._last_grad, float) else host_time_of(self._last_grad)
            self.comm.exposed_s += max(0.0, now - last)
        self._last_grad = None
        record_intervals(stamps, self.comm)
