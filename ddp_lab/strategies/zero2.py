"""`strategy=zero2`: ZeRO stage 2, gradients and optimizer state sharded over ranks.

Built on BucketedDDP's buckets (the same plan, `bucket_mb`, hooks and ordering rules of
overlap_engine.py), with each bucket split into N equal slices, one per rank, padded with zeros to
a multiple of N so any world size divides it (the padding is never a parameter):

- parameters: at construction every trainable parameter becomes a view into a flat, padded
  per-bucket buffer, so rank r's slice of a bucket is one contiguous range that may cut through
  parameters. The parts of parameters inside it are this rank's *shards*: 1-D views into the same
  buffer (`local_shards()`), the tensors the optimizer updates in place.
- backward: gradients accumulate into full-size buckets (views, as in BucketedDDP): the first
  bucket to fill is allocated at the training forward, each next one when the previous one gets
  its first gradient. When a bucket's last gradient is ready it is reduce-scattered while backward
  goes on: rank r receives the average of slice r into its persistent gradient shard (1/N of the
  bucket), and the full bucket is freed as soon as its collective is done (on CPU checked at each
  later launch, else after backward) for a later bucket to reuse. So the full gradient is not kept
  between steps, nor, on CPU, held all at once when
  communication keeps up with backward. Freed buckets are kept for the next step's first buckets
  (a fresh buffer costs page faults on CPU): the largest first, at most 2 x bucket_mb in bytes and
  always fewer than the step has buckets, so never the whole gradient (`kept_tensors()`, counted
  as strategy state by rank/memory.py).
  After `finish_gradient_synchronization()` the model's parameters have no `.grad`; each shard's
  `.grad` is its slice of the averaged gradient.
- step (`Zero2Optimizer`, from `make_optimizer`): the inner optimizer updates the shards (this
  rank's slice of every bucket, in place in the flat buffers), then every bucket is all-gathered,
  which writes the updated values straight into every rank's parameters. The wait is exposed
  optimizer comm, as zero1's is. The inner optimizer works on 1-D slices that cut through
  parameters, so it must be elementwise (AdamW, Adam, SGD with momentum); one that reads a whole
  tensor (a norm per parameter: LAMB, Adafactor) would see slices instead.

Collectives: one reduce-scatter per bucket and one all-gather per bucket, by the implementation
`backend.collectives` chooses (strategies/collectives.py: on gloo the lab's rings, which move what
NCCL's move; gloo's own builds reduce-scatter from an all-reduce). Payload per step: the padded
gradient bytes plus the padded parameter bytes, G + P, one all-reduce's worth.

Gradient accumulation: micro-batches inside `no_sync()` accumulate into the full-size buckets,
which stay allocated until the last micro-batch's backward reduce-scatters them (a shard cannot
hold a sum it has not received). So during accumulation a rank holds the full gradient, as plain
data parallelism does; DeepSpeed instead reduce-scatters every micro-batch (N-1 more reductions
per step) to keep only the shard. Between steps only the shard remains either way.

Frozen parameters (requires_grad False at wrap time) are in no bucket: not re-pointed, never
sent. Tied parameters appear once in `parameters()`, so once in a bucket. Unused parameters
contribute zeros (overlap_engine.py). Move the model to its device before wrapping it.
"""

from __future__ import annotations

import torch
from torch import nn

from ddp_lab.arithmetic.buckets import DEFAULT_BUCKET_MB
from ddp_lab.strategies.bucketed import BucketedDDP
from ddp_lab.strategies.collectives import (
    all_gather,
    collectives_in_use,
    from_wire,
    launch_stamped,
    reduce_scatter,
    to_wire,
)
from ddp_lab.strategies.comm_stats import Stamp
from ddp_lab.strategies.shard_optimizer import ShardOptimizerBase
from ddp_lab.units import MiB, tensor_bytes


class Zero2(BucketedDDP):
    """ZeRO-2 behind the strategy contract (module docstring): `Zero2(module, bucket_mb=25, comm_dtype="fp32")`."""

    keeps_buffers = False
    collectives: str | None = None
    """ring or native (strategies/collectives.py); None: what `backend.collectives` chose, read when built."""
    pool_buckets_mb: float | None = None
    """Bytes of freed bucket buffers kept between steps for the next step's first buckets (a fresh
    buffer costs page faults, slower on CPU than zeroing a warm one; DeepSpeed keeps its reduce
    buckets too), in MiB; None: 2 x bucket_mb. Always fewer buffers than buckets: never the whole
    gradient."""

    def __init__(self, module: nn.Module, bucket_mb: float = DEFAULT_BUCKET_MB, comm_dtype: str = "fp32",
                 process_group=None):
        super().__init__(module, bucket_mb, comm_dtype, process_group=process_group)
        self.rank = self.dp_rank
        self.collectives = self.collectives or collectives_in_use(process_group)
        self._on_cuda = any(unit[0].is_cuda for unit in self._units)
        self._params: list[torch.Tensor] = []       # flat, padded parameter buffer per bucket
        self._grad_shards: list[torch.Tensor] = []  # this rank's slice of each averaged gradient bucket
        self._shards: dict[int, tuple[nn.Parameter, int, int, int]] = {}  # id(param) -> (shard, bucket, lo, hi)
        self._pool: list[torch.Tensor] = []         # freed bucket buffers, reused by later buckets
        self._bases: dict[int, torch.Tensor] = {}   # bucket -> the pooled buffer its gradient bucket is a prefix of
        self._received: dict[int, torch.Tensor] = {}  # bucket in flight -> where this rank's averaged slice arrives
        with torch.no_grad():
            for index, unit in enumerate(self._units):
                flat = torch.zeros(self._lengths[index], dtype=unit[0].dtype, device=unit[0].device)
                width = self._lengths[index] // self.world_size
                mine = (self.rank * width, (self.rank + 1) * width)
                offset = 0
                for p in unit:
                    flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = flat[offset:offset + p.numel()].view_as(p)
                    lo, hi = max(offset, mine[0]), min(offset + p.numel(), mine[1])
                    if lo < hi:
                        self._shards[id(p)] = (nn.Parameter(flat[lo:hi]), index, lo - mine[0], hi - mine[0])
                    offset += p.numel()
                self._params.append(flat)
                self._grad_shards.append(torch.zeros(width, dtype=flat.dtype, device=flat.device))

    def _pad_multiple(self) -> int:
        return self.dp_size

    def local_shard(self, param: torch.Tensor) -> nn.Parameter | None:
        """This rank's slice of a trainable parameter (1-D, a view into its bucket), None if it has none."""
        entry = self._shards.get(id(param))
        return entry[0] if entry is not None else None

    def local_shards(self) -> list[nn.Parameter]:
        return [shard for shard, *_ in self._shards.values()]

    def is_sharded(self, param: torch.Tensor) -> bool:
        """True for the parameters this wrapper shards: the ones trainable when it was built."""
        return id(param) in self._unit_of

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], params=None, **kwargs) -> Zero2Optimizer:
        params = self.trainable_parameters() if params is None else params
        return Zero2Optimizer(params, optimizer_cls, shards=self, comm_stats=self.comm, **kwargs)

    # --- backward: reduce-scatter each bucket as it fills ------------------------------------------

    def _point_grads_at_buckets(self) -> None:
        """A training forward: accumulating (no_sync) needs every bucket; a synchronizing step only
        the first to fill, the next ones just in time (`_stage`), so freed ones can be reused."""
        if not self.require_sync:
            super()._point_grads_at_buckets()
        elif self._units:
            self._point_grads(0)

    def _stage(self, param: nn.Parameter) -> None:
        own = self._unit_of[id(param)]
        for index in (own, own + 1):  # its own bucket (if its gradient came early) and the one that fills next
            if self._next_unit <= index < len(self._units) and self._bucket_buffers[index] is None:
                self._point_grads(index)
        super()._stage(param)

    def _new_buffer(self, index: int) -> torch.Tensor:
        """A zeroed buffer for bucket `index`: a prefix of the smallest freed one that fits, or a new one."""
        length, like = self._lengths[index], self._units[index][0]
        kind = (like.dtype, like.device)
        fits = [i for i, b in enumerate(self._pool) if b.numel() >= length and (b.dtype, b.device) == kind]
        if fits:
            base = self._pool.pop(min(fits, key=lambda i: self._pool[i].numel()))
            buffer = base[:length].zero_()
        else:
            base = buffer = torch.zeros(length, dtype=like.dtype, device=like.device)
        self._bases[index] = base
        return buffer

    def _start_round(self) -> None:
        super()._start_round()
        self._reaped = 0  # launched units whose full bucket has been freed, in launch order

    def _launch_unit(self, index: int) -> tuple[torch.futures.Future, Stamp]:
        bucket, n = self._bucket(index), self.world_size
        # gloo has no AVG: divide first, then sum (as the all-reduces do); in comm_dtype (a copy) if it casts
        wire = to_wire(bucket, self.wire_dtype, n)
        shard = self._grad_shards[index]
        received = shard if wire is bucket else torch.empty(shard.shape, dtype=wire.dtype, device=wire.device)

        def launch():
            return [reduce_scatter(received, wire.view(-1), group=self.process_group, async_op=True,
                                   implementation=self.collectives)]
        self._received[index] = received
        return launch_stamped(launch, tensor_bytes(wire), self._on_cuda)

    def _launch_next(self) -> None:
        super()._launch_next()
        if not self._on_cuda:  # on CUDA a finished future means enqueued, not done: free after the wait
            while self._reaped < len(self._in_flight) and self._in_flight[self._reaped][0].done():
                self._reap()

    def _reap(self) -> None:
        """The next launched bucket's collective is done: keep this rank's slice, free the bucket."""
        index = self._reaped
        self._in_flight[index][0].wait()  # raises if the collective failed
        from_wire(self._received.pop(index), self._grad_shards[index])
        for p in self._units[index]:
            p.grad = None
            del self._view_of[id(p)]
        self._bucket_buffers[index] = None
        self._pool.append(self._bases.pop(index))
        self._reaped += 1

    def _synchronize_gradients(self) -> None:
        while self._next_unit < len(self._units):
            self._launch_next()
        for future, _ in self._in_flight:
            future.wait()
        while self._reaped < len(self._units):
            self._reap()
        for shard, index, lo, hi in self._shards.values():
            shard.grad = self._grad_shards[index][lo:hi]
        self._trim_pool()
        super()._synchronize_gradients()  # records the intervals, starts the next round

    def _trim_pool(self) -> None:
        """Keep the largest freed buffers within the pool's bytes, fewer than there are buckets."""
        cap = (2 * self.bucket_mb if self.pool_buckets_mb is None else self.pool_buckets_mb) * MiB
        kept, size = [], 0
        for buffer in sorted(self._pool, key=lambda b: b.numel(), reverse=True):
            if len(kept) + 1 < len(self._units) and size + tensor_bytes(buffer) <= cap:
                kept.append(buffer)
                size += tensor_bytes(buffer)
        self._pool = kept

    def kept_tensors(self) -> list[torch.Tensor]:
        """The pooled bucket buffers (and buckets still allocated: during accumulation)."""
        return super().kept_tensors() + self._pool

    # --- after the update: every rank gets every bucket's updated slices --------------------------

    @torch.no_grad()
    def all_gather_params(self, timed) -> None:
        """Share each rank's updated slices: `timed(nbytes, calls)` wraps the collectives (exposed)."""
        n = self.world_size
        if n == 1:
            return
        with timed(sum(tensor_bytes(flat) for flat in self._params), len(self._params)):
            works = []
            for flat in self._params:
                works.append(all_gather(flat, flat.view(n, -1)[self.rank], group=self.process_group,  # in place
                                        async_op=True, implementation=self.collectives))
            for work in works:
                work.wait()


class Zero2Optimizer(ShardOptimizerBase):
    """`optimizer_cls` on this rank's shards of `params` (Zero2's slices); all-gathers after each step.

    `param_groups` list the model's parameters as given (groups with their own hyperparameters,
    schedulers, `add_param_group` of parameters the wrapper shards); the inner optimizer holds the
    shards and their state. `zero_grad()` clears both the parameters' and the shards' gradients.
    Checkpoints: `state_dict()` is this rank's inner state only (keyed by shard), not consolidated.
    """

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], *, shards: Zero2, comm_stats=None,
                 **kwargs):
        self.shards = shards
        super().__init__(params, optimizer_cls, comm_stats=comm_stats, **kwargs)

    def _local_group(self, group: dict) -> dict:
        kept = []
        for i, p in enumerate(group["params"]):
            if p.requires_grad and not self.shards.is_sharded(p):
                raise ValueError("zero2 shards the parameters trainable when the model was wrapped; "
                                 f"this group has another one (shape {tuple(p.shape)})")
            if self.shards.local_shard(p) is not None:
                kept.append(i)
        local = {"params": [self.shards.local_shard(group["params"][i]) for i in kept]}
        if "param_names" in group:
            local["param_names"] = [group["param_names"][i] for i in kept]
        return local

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.optim.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optim.load_state_dict(state_dict)

    def _share_updates(self) -> None:
        self.shards.all_gather_params(self._timed)
