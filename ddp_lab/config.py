"""The typed schema of every config group: what each key means, and the options it takes.

Hydra merges each group's YAML and every command-line override into these dataclasses, so a wrong
type (`train.lr=abc`), an unknown key (`train.stepz=3`) or an unknown option (`backend.name=mpi`)
is refused by Hydra itself before launch.py runs a line of its own. Checks that need more than a
type (world_size > 0, a batch that divides by the ranks, memory) live in launcher/validate.py.

Options are `Choice` enums: a `str` that prints as its value, so code compares them with plain
strings and the config saved for the ranks holds plain strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from omegaconf import MISSING, DictConfig, OmegaConf


class Choice(str, Enum):
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class TaskName(Choice):
    train = "train"
    allreduce = "allreduce"


class CollectiveOp(Choice):
    all_reduce = "all_reduce"
    reduce_scatter = "reduce_scatter"
    all_gather = "all_gather"
    broadcast = "broadcast"
    reduce = "reduce"


class BackendName(Choice):
    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


class LoggerName(Choice):
    wandb = "wandb"
    none = "none"


class LoggerMode(Choice):
    offline = "offline"
    online = "online"
    disabled = "disabled"


class FaultKind(Choice):
    none = "none"
    crash = "crash"
    hang = "hang"
    oom = "oom"


class GradSync(Choice):
    """The gradient-sync strategies zero1 can average its gradients with."""

    naive = "naive"
    flat = "flat"
    overlap = "overlap"
    bucketed = "bucketed"
    torch_ddp = "torch_ddp"


class Dtype(Choice):
    """A floating-point format: of compute (train.precision) or of gradients on the wire (comm_dtype)."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class ShardPolicy(Choice):
    """fsdp: which parameters are sharded (ddp_lab/strategies/fsdp/policy.py)."""

    linear_embedding = "linear_embedding"
    """Weight matrices of Linear and Embedding layers; norms and biases replicated (CS336's split)."""
    all_params = "all_params"
    """Every parameter of one dimension or more (torch FSDP2's default)."""


class OuterOptimizer(Choice):
    """local_sgd: what is applied to the averaged change of the parameters at each sync."""

    none = "none"
    """Plain parameter averaging."""
    nesterov = "nesterov"
    """SGD with Nesterov momentum on the averaged change, as DiLoCo does."""


class ZeroComm(Choice):
    allreduce_broadcast = "allreduce_broadcast"
    """CS336's ZeRO-1: all-reduce the gradients, each owner broadcasts its updated parameters."""
    reduce_scatter = "reduce_scatter"
    """The ZeRO paper's: reduce-scatter gradients to their owners, all-gather the parameters."""


@dataclass
class TaskConfig:
    name: TaskName = TaskName.train
    """What each rank runs: `train`, or `allreduce` (the collective benchmark)."""
    op: CollectiveOp = CollectiveOp.all_reduce
    """task=allreduce: the collective to time."""
    size_mb: float = 10.0
    """task=allreduce: MiB of the whole message (nccl-tests' convention)."""
    iters: int = 20
    """task=allreduce: timed iterations (fewer when they would not fit in `time_budget_s`)."""
    warmup_iters: int = 5
    """task=allreduce: untimed iterations first."""
    time_budget_s: float = 120.0
    """task=allreduce: caps `iters` (never below 3) so a huge message still ends in minutes."""
    barrier: bool = True
    """task=allreduce: a barrier before each timed call (one collective alone); false times calls
    back to back, as a strategy issuing blocking collectives one after another does."""


@dataclass
class ModelConfig:
    """`_target_` is the model class (ddp_lab.models), `name` the group option (a label in results and
    W&B); the rest are the class's arguments (conf/model/*.yaml: CS336's Table 1 sizes and smaller)."""

    _target_: str = MISSING
    name: str = MISSING
    vocab_size: int = 10000
    context_length: int = 128
    """Tokens per sequence."""
    d_model: int = 768
    """Width of the residual stream (the toy MLP: of its embeddings)."""
    d_ff: int = 3072
    """Hidden width of each feed-forward block."""
    num_layers: int = 12
    num_heads: int = 12
    """Attention heads; d_model must divide by it. The toy MLP takes and ignores it."""
    rope_theta: float = 10000.0


@dataclass
class StrategyConfig:
    """A strategy YAML names its class (`_target_`) and sets its knobs; unset knobs stay None.

    The trainer builds `_target_(model, **knobs)` with the knobs that are set, so a knob is one
    field here, set in the YAMLs of the strategies that take it. Setting a knob the strategy's
    class does not take is refused before launch.
    """

    _target_: str = MISSING
    """The strategy class (ddp_lab.strategies)."""
    name: str = MISSING
    """The group option, so results and W&B runs say which strategy they measured."""
    bucket_mb: Optional[float] = None
    """Bucket cap in MiB (bucketed, torch_ddp as `bucket_cap_mb`, zero1's grad_sync)."""
    gradient_as_bucket_view: Optional[bool] = None
    """torch_ddp, zero1_torch: DDP's own knob; gradients as views into DDP's buckets, not a second copy."""
    grad_sync: Optional[GradSync] = None
    """zero1: the strategy that averages the gradients."""
    comm: Optional[ZeroComm] = None
    """zero1: the communication pattern of the sharded optimizer."""
    comm_dtype: Optional[Dtype] = None
    """Dtype of gradients on the wire; the averaged result lands in the fp32 gradient."""
    reshard_after_forward: Optional[bool] = None
    """fsdp, fsdp_torch: free a unit's gathered parameters after its forward, gather again for backward."""
    policy: Optional[ShardPolicy] = None
    """fsdp: which parameters are sharded (the rest are replicated, their gradients all-reduced)."""
    rank: Optional[int] = None
    """powersgd: rank of the low-rank approximation of each gradient matrix."""
    start_iter: Optional[int] = None
    """powersgd: plain all-reduce for the first start_iter steps."""
    sync_every: Optional[int] = None
    """local_sgd: average the parameters every sync_every steps (no gradient communication)."""
    outer: Optional[OuterOptimizer] = None
    """local_sgd: the outer optimizer applied at each sync."""


@dataclass
class BackendConfig:
    name: BackendName = BackendName.auto
    """auto: nccl when this node has a CUDA GPU per rank, else gloo on CPU."""
    timeout_s: float = 300.0
    """Collective timeout: a hung rank ends the job, never hangs it."""


@dataclass
class TrainConfig:
    steps: int = 20
    warmup_steps: int = 3
    """Steps excluded from the summaries."""
    batch_size: int = 8
    """Global batch, split across ranks."""
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0
    grad_accum_steps: int = 1
    """Micro-batches per step; communication only on the last."""
    save_model: bool = False
    """Rank 0 writes the final weights to JOB_DIR/model.pt."""
    precision: Dtype = Dtype.fp32
    """Compute dtype of forward and backward (autocast; fp16 adds a gradient scaler); master weights
    and optimizer state stay fp32. For fsdp and fsdp_torch it is also the dtype parameters are
    gathered in."""


@dataclass
class MeasureConfig:
    """Extra measurements that cost time of their own, off by default."""

    grad_error: bool = False
    """Each step, the relative error of the gradient a strategy delivered against the exact fp32
    average (one more all-reduce per step)."""


@dataclass
class LoggerConfig:
    name: LoggerName = LoggerName.wandb
    mode: LoggerMode = LoggerMode.offline
    """offline needs no account: `wandb sync outputs/.../wandb/offline-run-*` later."""
    project: str = "ddp-lab"
    entity: Optional[str] = None
    group: Optional[str] = None
    """None: one group per sweep (or per single run), named after its output folder."""


@dataclass
class LauncherConfig:
    """torchrun's own (static) rendezvous: world_size ranks split evenly over nnodes.

    node_rank 0 hosts the rendezvous at rdzv_endpoint (HOST:PORT) and global rank 0. Under a
    submitit launcher (SLURM) node_rank and rdzv_endpoint come from the job's environment.
    """

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: Optional[str] = None
    watchdog_s: float = 0.0
    """Last resort after backend.timeout_s: stop a job still running after this many seconds
    (0 = never). For what no collective timeout sees: every rank stuck outside a collective."""


@dataclass
class FaultConfig:
    """Make a rank fail on purpose at a step (ddp_lab/rank/faults.py)."""

    kind: FaultKind = FaultKind.none
    rank: int = 0
    """-1: every rank."""
    step: int = 0


@dataclass
class Config:
    task: TaskConfig = MISSING
    model: ModelConfig = MISSING
    strategy: StrategyConfig = MISSING
    backend: BackendConfig = MISSING
    logger: LoggerConfig = MISSING
    world_size: int = 2
    """Total ranks, split over launcher.nnodes."""
    train: TrainConfig = field(default_factory=TrainConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    profile: bool = False
    """torch.profiler traces of a few training steps, and the timeline picture."""
    resume: Optional[str] = None
    """A sweep or run folder: re-run its jobs that did not end ok."""


def register_configs() -> None:
    """Make the schema visible to Hydra as `base_config` (conf/config.yaml lists it first)."""
    ConfigStore.instance().store(name="base_config", node=Config)


NOT_ARGUMENTS = ("_target_", "name")

# Knobs a strategy's mode leaves unused (for run names): ZeRO-1's reduce-scatter replaces grad_sync.
UNUSED_KNOBS = {("comm", "reduce_scatter"): ("bucket_mb", "grad_sync")}


def set_knobs(node) -> dict[str, Any]:
    """The keys of a model or strategy node that are constructor arguments and set (not None)."""
    return {k: node[k] for k in node if k not in NOT_ARGUMENTS and node[k] is not None}


def used_knobs(strategy) -> dict[str, Any]:
    """`set_knobs` without the ones the strategy's mode ignores (UNUSED_KNOBS)."""
    knobs = set_knobs(strategy)
    unused = {k for (key, value), names in UNUSED_KNOBS.items() if str(knobs.get(key)) == value for k in names}
    return {k: v for k, v in knobs.items() if k not in unused}


def build(node: DictConfig, *args, **kwargs) -> Any:
    """Instantiate a model or strategy node: `_target_(*args, **set_knobs(node), **kwargs)`."""
    args_node = OmegaConf.masked_copy(node, ["_target_", *set_knobs(node)])
    return instantiate(args_node, *args, **kwargs)
