"""`strategy=deepspeed_zero1|2|3`: DeepSpeed's ZeRO engine behind the strategy contract, the bar users bring.

The engine is DeepSpeed's own (`deepspeed.initialize` around the user's model and the trainer's
AdamW, `zero_optimization.stage` 1, 2 or 3), driven by ddp-lab's trainer loop:

- forward runs `engine(...)`, which hooks the output so that a plain `loss.backward()` (what the
  trainer calls) runs DeepSpeed's backward prologue and epilogue: its gradient reduction (stage 1
  after backward, stages 2 and 3 in its gradient hooks) happens inside that backward, as with
  `engine.backward(loss)`;
- `make_optimizer` builds the engine (DeepSpeed needs the optimizer to wrap it) and returns an
  optimizer whose `step()` is `engine.step()` (the update of this rank's partition and the
  all-gather of the updated parameters) and whose `zero_grad()` is the engine's;
- `finish_gradient_synchronization()` has nothing left to wait for: it closes the step's figures.

Knobs: `bucket_mb` is DeepSpeed's `reduce_bucket_size` and `allgather_bucket_size` (stages 1, 2)
and `stage3_prefetch_bucket_size` (stage 3), which DeepSpeed counts in elements: bucket_mb MiB / 4
bytes per fp32 element, so a bucket holds what ours holds. `overlap_comm` is DeepSpeed's (False:
reductions block in the hook; True: on a side stream, or gloo's async work on CPU).

Communication is counted from what DeepSpeed issues: every call on deepspeed.comm's backend object
(`deepspeed.comm.comm.cdb`, through which all of ZeRO's collectives go) is wrapped to add its bytes
and its launch-to-completion interval (async calls end by their future's callback, as fsdp_torch's);
a blocking call during backward is a host wait (`CommStats.waited`, exposed on CPU), during the
optimizer step an exposed optimizer wait. What hides from the count: anything DeepSpeed sends with
torch.distributed directly rather than through deepspeed.comm (none in ZeRO 1-3's step paths in
0.19.8), and the host copies into and out of its flat buffers, which are compute here.

Memory: DeepSpeed flattens the parameters into one buffer per group (the parameters are views into
it), keeps an fp32 master copy of this rank's partition even when the model is fp32 (what the
inner AdamW updates), gradient partitions and reduction buffers: `kept_tensors()` hands every
tensor its ZeRO optimizer holds to the memory accounting, which counts each storage once and none
that holds a parameter, gradient or optimizer state.
"""

from __future__ import annotations

import os
import weakref
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.strategies.base import DataParallelBase
from ddp_lab.strategies.comm_stats import Stamp, begin_stamp, close_stamps, end_blocking, end_when_done
from ddp_lab.units import tensor_bytes

FP32_BYTES = 4
CHECKPOINT_TAG = "deepspeed"  # the folder engine.save_checkpoint writes inside a checkpoint's
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_base", "all_gather_coalesced",
               "all_to_all_single")


def _first_tensor_bytes(args, kwargs) -> int:
    """Bytes a call moves, by its largest tensor argument (the full buffer of an all-gather or reduce-scatter)."""
    found = []

    def visit(obj):
        if torch.is_tensor(obj):
            found.append(tensor_bytes(obj))
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                visit(o)

    for a in list(args) + list(kwargs.values()):
        visit(a)
    return max(found, default=0)


class DeepSpeedZeRO(DataParallelBase):
    """DeepSpeed's ZeRO engine at one stage (module docstring)."""

    def __init__(self, module: nn.Module, stage: int, bucket_mb: float = 25.0, overlap_comm: bool = False):
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator: gloo without oneCCL
        # DeepSpeed reads the launcher's LOCAL_RANK; torchrun sets it, ranks spawned on one machine may not
        os.environ.setdefault("LOCAL_RANK", str(torch.distributed.get_rank()))
        import deepspeed.comm.torch as ds_backend  # an optional extra: the spec refused the run without it

        # DeepSpeed's shared-memory all-reduce serves inference only (inference_all_reduce), which ZeRO
        # training never calls; building it JIT-compiles C++ in every new environment: not built here
        ds_backend.build_shm_op = lambda: None

        super().__init__(module)
        self.stage, self.bucket_mb, self.overlap_comm = stage, float(bucket_mb), bool(overlap_comm)
        self._engine: list = []          # not a registered submodule: parameters() stay the model's
        self._stamps: list[Stamp] = []
        self._in_step = False

    @property
    def engine(self):
        if not self._engine:
            raise RuntimeError("the DeepSpeed engine is built by make_optimizer(); call it first")
        return self._engine[0]

    def bucket_elements(self) -> int:
        """bucket_mb in fp32 elements, a multiple of DeepSpeed's alignment (2), at least 2."""
        return max(2, 2 * round(self.bucket_mb * 2**20 / FP32_BYTES / 2))

    def ds_config(self) -> dict:
        elements = self.bucket_elements()
        zero = {"stage": self.stage, "overlap_comm": self.overlap_comm, "reduce_bucket_size": elements}
        if self.stage < 3:
            zero.update(allgather_bucket_size=elements, contiguous_gradients=True)
        else:
            zero.update(stage3_prefetch_bucket_size=elements)
        return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                "zero_optimization": zero, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
                "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}

    def make_optimizer(self, optimizer_cls, params=None, **kwargs):
        import deepspeed

        optimizer = optimizer_cls(self.trainable_parameters() if params is None else params, **kwargs)
        engine, _, _, _ = deepspeed.initialize(model=self.module, optimizer=optimizer, config=self.ds_config(),
                                               dist_init_required=False)
        self._engine.append(engine)
        self._count_collectives()
        return _EngineOptimizer(self, engine, optimizer)

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs) if self._engine else self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        raise RuntimeError("deepspeed strategies take no gradient accumulation here (train.grad_accum_steps=1)")
        yield  # pragma: no cover

    def _count_collectives(self) -> None:
        """Wrap every collective of deepspeed.comm's backend (once per process) to record what it moves
        for the strategy that built the engine last (module docstring)."""
        from deepspeed.comm import comm as ds_comm

        backend = ds_comm.cdb
        on_cuda = torch.cuda.is_available()
        for name in COLLECTIVES:
            original = getattr(backend, name, None)
            if original is not None and not getattr(original, "_ddp_lab_counted", False):
                setattr(backend, name, _counted(original, on_cuda))
        _COUNTING[0] = weakref.ref(self)  # weak: a strategy that is gone is not kept alive by the wrappers

    def finish_gradient_synchronization(self) -> None:
        with self.comm.exposed():
            pass  # reduced inside backward (module docstring)

    def kept_tensors(self) -> list[torch.Tensor]:
        return _tensors_of(self.engine.optimizer) if self._engine else []

    def facts(self) -> dict:
        return {"deepspeed": {"stage": self.stage, "version": __import__("deepspeed").__version__,
                              "bucket_elements": self.bucket_elements(),
                              "overlap_comm": self.overlap_comm}}

    def save_own(self, folder) -> int:
        """DeepSpeed's own checkpoint (`engine.save_checkpoint`: its flat partitions, per rank): the bytes of
        this rank's files (rank 0 also writes the model's)."""
        self.engine.save_checkpoint(str(folder), tag=CHECKPOINT_TAG)
        rank = dist.get_rank()
        mine = [p for p in Path(folder, CHECKPOINT_TAG).iterdir()
                if f"zero_pp_rank_{rank}_" in p.name or (rank == 0 and p.name.startswith("mp_rank_"))]
        return sum(p.stat().st_size for p in mine)

    def load_own(self, folder) -> None:
        self.engine.load_checkpoint(str(folder), tag=CHECKPOINT_TAG)

    def full_state_dict(self) -> dict:
        """Every parameter whole (stage 3 gathers: collective, every rank calls it)."""
        if self.stage < 3 or not self._engine:
            return super().full_state_dict()
        import deepspeed

        params = list(self.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}


_COUNTING = [lambda: None]  # the strategy whose collectives are being counted


def _counted(original, on_cuda: bool):
    def call(*args, **kwargs):
        strategy = _COUNTING[0]()
        if strategy is None:
            return original(*args, **kwargs)
        stamp = begin_stamp(_first_tensor_bytes(args, kwargs), on_cuda)
        strategy._stamps.append(stamp)
        if kwargs.get("async_op"):
            work = original(*args, **kwargs)
            end_when_done(stamp, work, on_cuda)
            return work
        wait = strategy.comm.exposed(in_optimizer=True) if strategy._in_step else strategy.comm.waited()
        with wait if not on_cuda else nullcontext():
            work = original(*args, **kwargs)
        end_blocking(stamp, on_cuda)
        return work

    call._ddp_lab_counted = True
    return call


def _tensors_of(obj, depth: int = 0, seen=None) -> list[torch.Tensor]:
    """Every tensor an object keeps in its attributes, lists, tuples and dicts (a few levels down)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4:
        return []
    seen.add(id(obj))
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_of(v, depth + 1, seen)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors_of(v, depth + 1, seen)]
    if isinstance(obj, (torch.optim.Optimizer,)) or type(obj).__module__.startswith("deepspeed"):
        if isinstance(obj, nn.Module):
            return []
        return [t for v in vars(obj).values() for t in _tensors_of(v, depth + 1, seen)]
    return []


class _EngineOptimizer:
    """The optimizer the trainer steps: DeepSpeed's engine step; `.optim` the inner AdamW over this
    rank's fp32 partition (the memory accounting reads its state as the rank's own)."""

    def __init__(self, strategy: DeepSpeedZeRO, engine, inner: torch.optim.Optimizer):
        self.strategy, self.engine, self.optim = strategy, engine, inner

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def step(self, closure=None) -> None:
        self.strategy._in_step = True
        try:
            self.engine.step()
        finally:
            self.strategy._in_step = False
        close_stamps(self.strategy._stamps, self.strategy.comm)

    def state_dict(self) -> dict:
        return self.engine.optimizer.state_dict()
