"""The contract every runtime strategy keeps: `DataParallelBase` lists every member anything reads.

A strategy is an `nn.Module` around the user's model, built by its spec (ddp_lab/spec/strategies/)
as `RuntimeClass(model, **knobs)`. What the trainer, the memory accounting and the tests read of it,
each with its default here, so nothing is probed with getattr:

- construction broadcasts every parameter and buffer from rank 0, frozen ones included;
- `process_group` (a constructor argument, as torch's DDP takes it): the ranks it synchronizes over, the mesh's
  data-parallel axis under tensor parallelism (ddp_lab/parallel/); None, the default, is every rank. Every
  collective a strategy issues goes over it, its means divide by its size (`dp_size`), and the broadcast at
  construction comes from its first rank;
- `replicas` (a constructor argument of the strategies whose spec takes one: `expert_refusal is None`): the
  replica map (strategies/replicas.py), per class of parameters the group holding identical copies, the divisor
  of their mean and the broadcast's source; given under expert parallelism, where experts are copied over another
  group than the dense weights. Unset, it is one class over `process_group`, exactly the single group above;
- `forward(*args, **kwargs)` runs the wrapped model (`.module`);
- `make_optimizer(optimizer_cls, params=None, **kwargs)` builds the optimizer: a plain one over
  the trainable parameters (or the given params / param groups), or a strategy's own (a sharded one
  keeps only this rank's state; local_sgd's plain one averages parameters from a step post-hook);
- `finish_gradient_synchronization()` is called after the last `backward()` of a step and before
  `optimizer.step()`, and leaves the rank-averaged gradient in every `.grad` the optimizer reads;
- `grad_scale` is set by the train step before backward: the factor the coming gradients carry
  (fp16's loss scale, else 1), for a strategy that keeps gradient-derived state across steps;
- `no_sync()` is a context in which backward must not communicate (gradient accumulation), as in
  torch's DistributedDataParallel; `reduces_after_no_sync`: whether `finish_gradient_synchronization()` reduces
  gradients every backward of the step accumulated inside it (True for all but FSDP2's, which reduce only in a
  backward outside it; under a pipeline they turn sync off for the whole step in `before_pipeline_step()` and
  reduce in `finish_gradient_synchronization()` instead, and a weight tied across stages is summed after that);
- `comm` is a `CommStats`: the trainer pops one step's figures from it;
- `facts()`: what to record once per run (a bucket plan), `{}` when nothing;
- `compile_model(backend)`: `train.compile`, in place (each unit's forward by default, `compile_units`; torch's
  DDP the DDP model);
- `full_state_dict()`: the wrapped model's state dict with every parameter whole (what
  `train.save_model` writes; a plain model loads it); collective for strategies that shard
  parameters, so every rank calls it;
- `kept_tensors()`: every tensor the strategy keeps from one step to the next beyond parameters,
  gradients and optimizer state (buckets, error feedback, anchors), for the memory accounting
  (rank/memory.py counts each storage once, and none that holds model state); `[]` when nothing;
- `peak_gathered_bytes`: the most bytes of gathered parameters held at once (ZeRO-3), None where
  nothing is gathered;
- `unsharded_bytes`: the most bytes of whole parameters and gradients held beside the shards through a step (FSDP2
  under a pipeline, gathered once a step and reduced once after it), None where nothing whole outlives a unit's
  use; the memory accounting adds it to the shards' state at that peak (rank/memory.py);
- `checkpoint_params()` and `checkpoint_optimizer(optimizer)`: where this rank keeps each piece of the
  parameters and of the optimizer state (strategies/checkpoint_layout.py), which rank/checkpoint.py
  saves where it lies and loads any other layout's checkpoint into; whole parameters and the optimizer's
  (or its inner, sharded optimizer's) own tensors by default;
- `checkpoint_rank_state()` and `load_rank_state(state)`: state that is this rank's alone (powersgd's
  error feedback, local SGD's own parameters between syncs), saved per rank and given back only at the
  same world size; `load_rank_state({})` after a load that has none of it, to start that state afresh
  from the loaded model; `checkpoint_consensus(optimizer)`: a context in which the live parameters and
  optimizer state are what every rank agrees on, for the pieces another strategy loads (every
  strategy's already are, but local SGD's between syncs); `save_own(folder)` and `load_own(folder)`:
  a strategy whose spec names an `own_checkpoint` format (DeepSpeed's) writes and reads its state in
  it instead of DCP pieces.

What a strategy *is* (its name, ZeRO stage, whether it reduces gradients, its schedule, the model
it needs) is its spec's to say, not the runtime class's.

`comm_dtype` (`strategy.comm_dtype`: fp32, bf16, fp16) is the dtype gradients travel in; the
average lands in the fp32 `.grad` (strategies/collectives.py's `to_wire` / `from_wire`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.strategies.checkpoint_layout import Pieces, optimizer_pieces, whole_parameters
from ddp_lab.strategies.collectives import wire_dtype
from ddp_lab.strategies.comm_stats import CommStats
from ddp_lab.strategies.replicas import ReplicaMap


def compile_units(module: nn.Module, backend: str, units: list[nn.Module] | None = None) -> None:
    """torch.compile `units` (default: fsdp's units of `module`, spec/strategies/fsdp_units.py: the embedding,
    each block, the output head) each on its own forward, in place, as torchtitan compiles a model's blocks;
    the whole model (`nn.Module.compile`) where it has no unit. Hooks on the units and their parameters stay
    eager, outside every graph. Compiled whole, backward is one autograd node and every gradient is ready at its
    end, so nothing a hook launches can overlap backward (measured: docs/benchmarks.md, "Overlap under
    torch.compile"); compiled per unit, backward is one node per unit and gradients become ready unit by unit,
    as eagerly but coarser. Units of one class (the blocks) share one compiled graph."""
    if units is None:
        from ddp_lab.spec.strategies.fsdp_units import unit_modules

        units = unit_modules(module)
    if not units:
        module.compile(backend=backend)
    for unit in units:
        unit.forward = torch.compile(unit.forward, backend=backend)


def module_device(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")


class DataParallelBase(nn.Module):
    grad_scale = 1.0
    """What the gradients of the coming backward are multiplied by: fp16's loss scale, set by the
    train step before each backward (PowerSGD keeps its error feedback in unscaled units with it)."""

    peak_gathered_bytes: int | None = None
    unsharded_bytes: int | None = None
    reduces_after_no_sync = True

    def __init__(self, module: nn.Module, comm_dtype: str = "fp32", broadcast: bool = True, process_group=None,
                 replicas: ReplicaMap | None = None):
        """`broadcast=False` for a wrapper around a strategy that has broadcast the model already (zero1);
        `process_group`: the ranks to synchronize over (None: all of them); `replicas`: a map with more classes
        than that one group (its dense class's group is then the process group)."""
        super().__init__()
        self.module = module
        self.comm_dtype = str(comm_dtype)
        self.wire_dtype = wire_dtype(comm_dtype)
        self.comm = CommStats(module_device(module))
        self.require_sync = True
        if replicas is not None:
            process_group = replicas.dense.group
        self.process_group = process_group
        distributed = dist.is_available() and dist.is_initialized()
        self.dp_size = dist.get_world_size(process_group) if distributed else 1
        self.dp_rank = dist.get_rank(process_group) if distributed else 0
        self.replicas = replicas if replicas is not None else ReplicaMap.single(process_group)
        if broadcast:
            self.replicas.broadcast(module)  # one class: every tensor from the group's first rank, as always

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def before_pipeline_step(self) -> None:
        """Called by a pipeline schedule (pipeline_parallel/lab.py, torch_schedule.py) as each step begins, before
        its forwards and backwards under `no_sync()`. A strategy that gathers its parameters may gather them now,
        under the schedule's first waits, and keep them until the step's last backward, as torchtitan runs FSDP
        under a pipeline (fsdp_torch); one that reduces in backward hooks may turn them off for the step and reduce
        in `finish_gradient_synchronization()` (fsdp_torch, replicate_torch). Nothing by default."""

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the step after the context synchronizes the sum."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters that receive gradients, each once even when tied, in `parameters()` order."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], params=None,
                       **kwargs) -> torch.optim.Optimizer:
        """`optimizer_cls` over `params` (default: the trainable parameters; param groups welcome);
        sharding strategies return their own optimizer instead."""
        return optimizer_cls(self.trainable_parameters() if params is None else params, **kwargs)

    def compile_model(self, backend: str) -> None:
        """`train.compile`: the wrapped model compiled unit by unit, in place (`compile_units`: names, state dict
        and parameters unchanged), so the strategy's hooks on parameters still see gradients arrive during
        backward, a unit at a time."""
        compile_units(self.module, backend)

    def facts(self) -> dict:
        return {}

    def kept_tensors(self) -> list[torch.Tensor]:
        return []

    def full_state_dict(self) -> dict:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def checkpoint_params(self) -> Pieces:
        """Each parameter by its name in the wrapped model: its full shape and the pieces this rank holds."""
        return whole_parameters(self.module)

    def checkpoint_optimizer(self, optimizer) -> tuple[torch.optim.Optimizer, dict[int, tuple[str, int]]]:
        """The optimizer holding this rank's state (a sharded optimizer's inner one) and, per tensor it
        updates (by id), the parameter it is a piece of and the piece's offset."""
        inner = getattr(optimizer, "optim", None)
        inner = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
        return inner, optimizer_pieces(inner, self.module)

    def checkpoint_rank_state(self) -> dict[str, torch.Tensor]:
        """This rank's own state by name (1-D tensors, copies or live), saved for this rank only."""
        return {}

    def load_rank_state(self, state: dict[str, torch.Tensor]) -> bool:
        """After a load: take `checkpoint_rank_state()`'s tensors as this rank saved them at this world size
        (whatever of them the checkpoint had), or, where it had none that fit, start that state afresh from the
        loaded parameters. Whether it was taken."""
        return False

    def save_own(self, folder) -> int:
        """A strategy whose spec names an `own_checkpoint` format writes this rank's state into `folder` in it;
        the bytes this rank wrote."""
        raise NotImplementedError(f"{type(self).__name__} checkpoints as DCP pieces (checkpoint_params)")

    def load_own(self, folder) -> None:
        """Read back what `save_own` wrote (the same strategy, at the same world size)."""
        raise NotImplementedError(f"{type(self).__name__} checkpoints as DCP pieces (checkpoint_params)")

    @contextmanager
    def checkpoint_consensus(self, optimizer):
        """While a checkpoint is taken: the parameters and optimizer state every rank agrees on."""
        yield

    def finish_gradient_synchronization(self) -> None:
        with self.comm.exposed():
            self._synchronize_gradients()

    def _synchronize_gradients(self) -> None:
        raise NotImplementedError
