"""What every process knows of a strategy without running it: its knobs, its capabilities, its
collective schedule and the class that runs it.

A spec is a dataclass. Its fields are the strategy's knobs (`strategy.KNOB=...` on the command
line), each with its type, its default (written here once) and a docstring; `conf/strategy/NAME.yaml`
names the spec in its defaults list, so Hydra composes the YAML on it and refuses a wrong type or a
knob the strategy does not have before anything runs. A knob that defaults to None is optional: it is
left out of the runtime's arguments and of run names until it is set (`comm_dtype`). `check()` refuses
values the type cannot (ranges, knobs a mode ignores); it runs when the spec is built.

Its class variables and methods are what the launcher, the ranks and analysis ask of a strategy,
instead of probing the runtime class or matching its name:

- `runtime`: the dotted path of the runtime class (ddp_lab/strategies), imported only inside a rank
  (`build`): the launcher checks a model with `check_model` on the meta device, never the runtime;
- `zero_stage`: what it shards, as the ZeRO paper counts (0 nothing, 1 optimizer state, 2 also
  gradients, 3 also parameters): the memory accounting, the pre-launch memory estimate, grad_error;
- `reduces_gradients`: False when no gradient collective runs (local SGD averages parameters):
  comm_dtype is refused, fp16's loss scaler agrees over ranks;
- `casts_itself`: takes train.precision as `compute_dtype` (the dtype it gathers parameters in)
  instead of autocast (fsdp);
- `own_checkpoint`: the name of the format its checkpoints are written in where its state is not
  torch.distributed.checkpoint's pieces ("deepspeed": its engine's `save_checkpoint`), which loads only
  into the same strategy at the same world size and takes no other's; None: DCP pieces, from any
  strategy and into any, at any world size (rank/checkpoint.py);
- `whole_parameter_optimizer`: its optimizer updates whole parameters (False where it sees flat slices:
  zero2, fsdp, hsdp, fsdp_torch, DeepSpeed; or brings its own: demo), which `train.optimizer=muon` needs;
- `compile_refusal`: why the strategy cannot run with `train.compile=true` (None: it can);
- `synchronizes`: False for the floor (`strategy=none`): no rank hears from another, each trains alone;
- `torch_reference`: the option of torch's own implementation of the same algorithm (bucketed's is torch_ddp,
  zero2's zero1_torch, fsdp's fsdp_torch), the bar tables divide its step by; None where torch has none;
- `emulated_nodes`: it runs across emulated nodes (False: local_sgd_torchft, whose servers advertise a host
  name another namespace cannot reach);
- `mesh_refusal`: why the strategy cannot synchronize over a mesh's data-parallel axis (`parallel.tp`, `pp` or
  `cp` > 1), None where it can: its runtime takes `process_group` and issues every collective over it
  (all of the lab's and torch's; a strategy of your own says None once its runtime does);
- `pipeline_refusal`: why it cannot synchronize under a pipeline schedule, which runs several micro-batches'
  forwards before their backwards (the lab's fsdp); `check_mesh(tp, pp, pp_schedule, cp)` asks both, and what a knob
  or a schedule rules out on a mesh;
- `expert_refusal`: why the strategy cannot run under expert parallelism (`parallel.ep > 1`), None where it can:
  its runtime takes a `replicas` map (strategies/replicas.py) and reduces each class of parameters over its own
  group with its own divisor (the experts' copies live on another group than the dense weights'); `check_experts(ep)`
  asks it;
- `torch_comm_hooks()`: comm_dtype goes through torch DDP's comm hooks (bf16 only on CUDA + NCCL);
- `used_knobs()`: the knobs that shape this run, for run names and table rows (a mode may leave some
  unused);
- `schedule()`: its collectives as data (spec/schedule.py) for the predictor and the calculator;
  None: not replayed;
- `check_world(world_size, ranks_per_node)`, `shard_ranks(...)`: the ranks it needs, and how many
  share what it shards (hsdp: its shard group; everyone else: all ranks);
- `check_run(precision, grad_accum_steps)`: what the run needs beyond its ranks (an optional extra
  installed, the train settings it takes), asked before launch;
- `check_checkpoints()`: whether it can write checkpoints with these knobs (local_sgd's delayed syncs cannot:
  a checkpoint would miss what is in flight);
- `check_model(module)`: the model it needs: raise ValueError (one line) for a model it cannot wrap
  (fsdp: nothing to shard); the launcher asks before any rank starts, on the model built on the meta
  device.

Nothing here imports torch: the launcher, analysis and any offline tool read specs freely.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Optional

from omegaconf import MISSING

from ddp_lab.spec.schedule import Schedule

NOT_KNOBS = ("_target_", "name")


@dataclass
class StrategySpec:
    """The base every strategy's spec extends (spec/strategies/*.py)."""

    _target_: str = MISSING
    """This spec's own class: any saved config (results.json's too) leads back to it."""
    name: str = MISSING
    """The strategy's option in the `strategy` group: results, tables and W&B runs say which they measured."""

    runtime: ClassVar[str]
    zero_stage: ClassVar[int] = 0
    reduces_gradients: ClassVar[bool] = True
    casts_itself: ClassVar[bool] = False
    own_checkpoint: ClassVar[Optional[str]] = None
    whole_parameter_optimizer: ClassVar[bool] = True
    emulated_nodes: ClassVar[bool] = True
    synchronizes: ClassVar[bool] = True
    compile_refusal: ClassVar[Optional[str]] = None
    torch_reference: ClassVar[Optional[str]] = None
    mesh_refusal: ClassVar[Optional[str]] = ("its runtime class is not said to take process_group, the mesh's "
                                             "data-parallel axis to synchronize over (a spec whose runtime does "
                                             "sets mesh_refusal = None)")
    pipeline_refusal: ClassVar[Optional[str]] = None
    expert_refusal: ClassVar[Optional[str]] = (
        "its runtime takes one process group for every parameter, and an expert's copies live on another group "
        "(its expert-data-parallel group) with another divisor: not built for it yet (strategies/replicas.py; a spec "
        "whose runtime takes `replicas` sets expert_refusal = None)")

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ValueError, one line, for a knob value its type allows but the strategy cannot take."""

    def knobs(self) -> dict[str, Any]:
        """The runtime class's keyword arguments: every knob that is set (not None)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in NOT_KNOBS and getattr(self, f.name) is not None}

    def used_knobs(self) -> dict[str, Any]:
        """The knobs that shape this run (run names, table rows): all set knobs unless a mode ignores some."""
        return self.knobs()

    def torch_comm_hooks(self) -> bool:
        """Whether gradients (and so `comm_dtype`) go through torch DDP's comm hooks."""
        return False

    def schedule(self) -> Optional[Schedule]:
        """The collectives of one step (spec/schedule.py); None for a strategy the predictor does not replay."""
        return None

    def check_world(self, world_size: int, ranks_per_node: int) -> None:
        """Raise ValueError, one line, when the ranks do not split into the groups that share what the
        strategy shards (`shard_ranks`: hsdp's shard groups, fsdp_torch's with shard_size)."""
        shard = self.shard_ranks(world_size, ranks_per_node)
        require(world_size % shard == 0, f"strategy.shard_size={shard} does not divide world_size={world_size}")

    def shard_ranks(self, world_size: int, ranks_per_node: int) -> int:
        """How many ranks share what the strategy shards (its ZeRO fraction is 1/this): all of them, but
        for hsdp, the shard group."""
        return world_size

    def check_mesh(self, tp: int, pp: int = 1, pp_schedule: str = "1f1b", cp: int = 1) -> None:
        """Raise ValueError, one line, when the strategy cannot run on the data-parallel axis of a mesh with `tp`
        tensor-parallel ranks, `pp` pipeline stages run by `pp_schedule` and `cp` context-parallel ranks (whose
        gradients it then averages too: ddp_lab/spec/parallel.py)."""
        require((tp == 1 and pp == 1 and cp == 1) or self.mesh_refusal is None,
                f"{mesh_keys(tp, pp, cp)}: strategy={self.name} does not run on a mesh's data-parallel axis: "
                f"{self.mesh_refusal}")
        require(cp == 1 or self.synchronizes, f"parallel.cp={cp}: strategy={self.name} synchronizes nothing, and "
                "context-parallel ranks must average their gradients (each saw its own tokens of every sequence): use "
                "a strategy that does (flat, bucketed, torch_ddp, ...)")
        require(pp == 1 or self.pipeline_refusal is None,
                f"parallel.pp={pp}: strategy={self.name} does not run under a pipeline schedule: "
                f"{self.pipeline_refusal}")

    def check_experts(self, ep: int) -> None:
        """Raise ValueError, one line, when the strategy cannot synchronize under expert parallelism of degree `ep`."""
        require(ep == 1 or self.expert_refusal is None,
                f"parallel.ep={ep}: strategy={self.name} does not run under expert parallelism: {self.expert_refusal}")

    def check_run(self, precision: str, grad_accum_steps: int) -> None:
        """Raise ValueError, one line, for what this run needs that is not there (an optional extra) or a
        train setting the strategy cannot take (train.precision, train.grad_accum_steps); all fine by default."""

    def check_checkpoints(self) -> None:
        """Raise ValueError, one line, when the strategy cannot write checkpoints as configured (checkpoint.every
        is set); all fine by default."""

    def check_model(self, module) -> None:
        """Raise ValueError, one line, when the strategy cannot wrap `module` (a torch model, on the meta
        device before launch); every model is fine by default."""

    @classmethod
    def runtime_class(cls) -> type:
        module, _, name = cls.runtime.rpartition(".")
        return getattr(importlib.import_module(module), name)

    def build(self, module, **extra):
        """The runtime strategy around `module` (in a rank: imports torch and the runtime class)."""
        return self.runtime_class()(module, **self.knobs(), **extra)


def require(ok: bool, message: str) -> None:
    """`check()`'s one-line refusal."""
    if not ok:
        raise ValueError(message)


def mesh_keys(tp: int, pp: int, cp: int = 1) -> str:
    """The keys that made a mesh, for a refusal: `parallel.tp=2`, `parallel.pp=2`, `parallel.cp=2`, or several."""
    return ", ".join(f"parallel.{k}={v}" for k, v in (("tp", tp), ("pp", pp), ("cp", cp)) if v > 1) or "parallel.tp=1"


def knob_at_least(spec: StrategySpec, knob: str, least: float, strictly: bool = False) -> None:
    value = getattr(spec, knob)
    require(value is None or (value > least if strictly else value >= least),
            f"strategy.{knob} must be {'>' if strictly else '>='} {least:g}, got {value}")
