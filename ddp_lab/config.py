"""The typed schema of every config group: what each key means, and the options it takes.

Hydra merges each group's YAML and every command-line override into these dataclasses, so a wrong
type (`train.lr=abc`), an unknown key (`train.stepz=3`) or an unknown option (`backend.name=mpi`)
is refused by Hydra itself before launch.py runs a line of its own. Checks that need more than a
type (world_size > 0, a batch that divides by the ranks, memory) live in launcher/config_checks.py.

Options are `Choice` enums: a `str` that prints as its value, so code compares them with plain
strings and the config saved for the ranks holds plain strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from omegaconf import MISSING, DictConfig, OmegaConf

from ddp_lab.spec.choices import Choice, CollectiveOp, Dtype
from ddp_lab.spec.models import MODEL_SCHEMAS
from ddp_lab.spec.parallel import ParallelConfig, layout_of
from ddp_lab.spec.strategies import register as register_strategy_specs


class TaskName(Choice):
    train = "train"
    allreduce = "allreduce"


class BackendName(Choice):
    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


class Collectives(Choice):
    auto = "auto"
    ring = "ring"
    native = "native"


class LoggerName(Choice):
    wandb = "wandb"
    none = "none"


class LoggerMode(Choice):
    offline = "offline"
    online = "online"
    disabled = "disabled"


class DataName(Choice):
    synthetic = "synthetic"
    text = "text"
    tokens = "tokens"


class TokenFormat(Choice):
    auto = "auto"
    raw = "raw"
    llmc = "llmc"
    npy = "npy"


class TokenDtype(Choice):
    uint16 = "uint16"
    uint32 = "uint32"


class OptimizerName(Choice):
    adamw = "adamw"
    muon = "muon"


class Checkpointing(Choice):
    none = "none"
    full = "full"
    selective = "selective"


class FaultKind(Choice):
    none = "none"
    crash = "crash"
    hang = "hang"
    oom = "oom"
    slow = "slow"


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
class DataConfig:
    """What every data source's node has; each source (conf/data/NAME.yaml) extends its own node below,
    stored as `schema/data/NAME`. How each is read: ddp_lab/data/ and docs/data.md."""

    name: DataName = MISSING


@dataclass
class SyntheticData(DataConfig):
    """Counting sequences drawn from (seed, step) below model.vocab_size: no file, a sanity check."""

    name: DataName = DataName.synthetic


@dataclass
class TextData(DataConfig):
    """UTF-8 text read as bytes (token ids 0-255: model.vocab_size is 256)."""

    name: DataName = DataName.text
    path: Optional[str] = None
    """A UTF-8 text file, a folder or a glob of them; None: the built-in corpus (Python's help() topics)."""
    val_path: Optional[str] = None
    """Text to validate on instead of holding out data.val_fraction of data.path."""
    val_fraction: float = 0.1
    """The last share of the tokens held out for the validation loss (0: none)."""


@dataclass
class TokensData(TextData):
    """Token files: nanoGPT/CS336 raw arrays, llm.c shards, .npy (ddp_lab/data/files.py)."""

    name: DataName = DataName.tokens
    path: Optional[str] = MISSING
    """A token file, a folder of shards (its .bin and .npy files) or a glob."""
    format: TokenFormat = TokenFormat.auto
    """auto: .npy by its suffix, an llm.c magic in the first 4 bytes as llm.c, anything else raw."""
    dtype: TokenDtype = TokenDtype.uint16
    """Token dtype of a raw (headerless) file; llm.c and .npy files say their own."""


class NetworkName(Choice):
    host = "host"
    emulated = "emulated"


@dataclass
class NetworkConfig:
    """How the ranks' nodes are joined; each option (conf/network/NAME.yaml) extends its own node below."""

    name: NetworkName = MISSING


@dataclass
class HostNetwork(NetworkConfig):
    """The machine's own network: ranks of one node talk over loopback, nodes over the real network."""

    name: NetworkName = NetworkName.host


@dataclass
class EmulatedNetwork(NetworkConfig):
    """Nodes emulated on this machine: network namespaces joined by shaped links
    (ddp_lab/launcher/emulated_network.py; needs root and iproute2)."""

    name: NetworkName = NetworkName.emulated
    nodes: int = 2
    """Emulated nodes; world_size splits evenly over them."""
    gbps: Optional[float] = None
    """Each node's link rate in Gbit/s, both directions (a tbf qdisc on both ends); None: unshaped."""
    slow_node: Optional[int] = None
    """A node whose link runs at `slow_gbps` instead (a slow link, for the straggler study); None: none."""
    slow_gbps: Optional[float] = None
    """The slow node's link rate in Gbit/s, both directions."""
    slow_step: int = 0
    """The step from which the slow node's link runs at `slow_gbps` (before it: at `gbps`). The launcher
    changes both ends of the link once rank 0 has recorded the step before, so the change lands early in
    this step; results.json's `summary.injected_link` says in which step it was made."""
    latency_ms: Optional[float] = None
    """Added one-way delay on each node's link (the netem qdisc: refused where the kernel lacks it)."""


NETWORK_SCHEMAS = {"host": HostNetwork, "emulated": EmulatedNetwork}

DATA_SCHEMAS = {"synthetic": SyntheticData, "text": TextData, "tokens": TokensData}
"""Each data source's node, stored as `schema/data/NAME` (conf/data/*.yaml list it in their defaults)."""


@dataclass
class BackendConfig:
    name: BackendName = BackendName.auto
    """auto: nccl when this node has a CUDA GPU per rank, else gloo on CPU."""
    timeout_s: float = 300.0
    """Collective timeout: a hung rank ends the job, never hangs it."""
    collectives: Collectives = Collectives.auto
    """Reduce-scatter, all-gather and post-step broadcasts of every sharding strategy: ring (the lab's
    bandwidth-optimal rings and chains over point-to-point, gloo only), native (the backend's own: gloo's
    reduce-scatter is an all-reduce underneath, its broadcast sends every copy from the source), auto
    (ring on gloo, native on nccl)."""


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
    eval_every: int = 0
    """The validation loss every N steps (0: after the last step only); it is not timed as a step."""
    eval_batches: int = 4
    """Global batches (train.batch_size sequences each) the validation loss averages; 0: no validation loss."""
    save_model: bool = False
    """Rank 0 writes the final weights to JOB_DIR/model.pt."""
    optimizer: OptimizerName = OptimizerName.adamw
    """adamw; or muon: torch's Muon on every 2-D parameter and AdamW on the rest, at train.lr and
    train.weight_decay (rank/optimizers.py). Strategies whose optimizer sees slices of a parameter refuse muon."""
    precision: Dtype = Dtype.fp32
    """Compute dtype of forward and backward (autocast; fp16 adds a gradient scaler); master weights
    and optimizer state stay fp32. For fsdp and fsdp_torch it is also the dtype parameters are
    gathered in."""
    compile: bool = False
    """torch.compile the model's forward (and through AOTAutograd its backward), in place, as the strategy's
    `compile_model` says (unit by unit for most, so gradients still arrive during backward; torch's DDP as torch
    documents it, the DDP-wrapped model whole).
    The first step compiles: it is a warm-up step, and the summary's `compile` says how long it took beyond a
    measured step. A strategy that cannot run compiled is refused before launch, saying why."""
    activation_checkpointing: Checkpointing = Checkpointing.none
    """Recompute instead of keeping activations, block by block (rank/recompute.py): full (each block keeps its
    input, its forward runs again in backward) or selective (each block keeps its matmuls' outputs and recomputes
    the rest, attention's kernel included); the trained weights are bit for bit those without it. The planner's
    memory lever (docs/plan.md). Data parallelism only for now: refused with tp, pp, cp or train.compile."""
    compile_backend: str = "inductor"
    """torch.compile's backend: inductor (the default, generated kernels), aot_eager (graphs traced, forward and
    backward, run by eager kernels: what the CPU parity tests use, no C++ compiler needed), eager."""


@dataclass
class MeasureConfig:
    """Measurements that cost time of their own: the extra ones off by default, the per-collective stamps on
    (with a switch, so their cost is measured)."""

    grad_error: bool = False
    """Each step, the relative error of the gradient a strategy delivered against the exact fp32
    average (one more all-reduce per step)."""
    per_collective: bool = True
    """Stamp every collective (its in-flight interval: a clock, on CUDA two events and a completion callback),
    which comm_ms, the overlap % and the straggler figures need. false: collectives are only counted, so a
    run measures what the stamps themselves cost (benchmarks/gpu.sh runs both); for torch_ddp it is torch's
    DDP bare, with none of the lab's hooks."""


@dataclass
class LoggerConfig:
    name: LoggerName = LoggerName.wandb
    mode: LoggerMode = LoggerMode.offline
    """offline needs no account: `wandb sync outputs/.../wandb/offline-run-*` later."""
    project: str = "ddp-lab"
    entity: Optional[str] = None
    group: Optional[str] = None
    """None: one group per sweep (or per single run), named after its output folder."""
    dir: Optional[str] = None
    """The folder W&B's runs go under (DIR/wandb). None: the sweep's folder for every job of a sweep (one
    `wandb leet SWEEP/wandb` compares them), the job's own for a single run; launch.py fills it in."""


@dataclass
class LauncherConfig:
    """torchrun's own (static) rendezvous: world_size ranks split evenly over nnodes.

    node_rank 0 hosts the rendezvous at rdzv_endpoint (HOST:PORT) and global rank 0. Under a
    submitit launcher (SLURM) node_rank and rdzv_endpoint come from the job's environment.
    """

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: Optional[str] = None
    max_restarts: int = 0
    """torchrun's --max-restarts: when a rank fails, restart every worker this many times at most; each
    restart goes on from the job's newest checkpoint (needs checkpoint.every)."""
    watchdog_s: float = 0.0
    """Last resort after backend.timeout_s: stop a job still running after this many seconds
    (0 = never). For what no collective timeout sees: every rank stuck outside a collective."""


@dataclass
class FaultConfig:
    """Make a rank fail on purpose at a step, or compute slower from a step on (ddp_lab/rank/faults.py)."""

    kind: FaultKind = FaultKind.none
    rank: int = 0
    """-1: every rank."""
    node: Optional[int] = None
    """Every rank of this node instead of `rank` (torchrun's GROUP_RANK: a node of launcher.nnodes, or an
    emulated node): a slow node."""
    step: int = 0
    slowdown: float = 2.0
    """kind=slow: the rank's forward and backward take this many times as long, from `step` on (> 1)."""


@dataclass
class CheckpointConfig:
    """Checkpoints written with torch.distributed.checkpoint, each rank its own pieces (rank/checkpoint.py,
    docs/checkpoints.md): loadable by any strategy at any world size."""

    every: int = 0
    """Save after every N steps and after the last one; 0: never."""
    keep: int = 2
    """Complete checkpoints kept in JOB/checkpoints/ (the newest ones); 0: every one."""
    load: Optional[str] = None
    """Start from a checkpoint: a step folder (JOB/checkpoints/step_N) or a job folder (its newest one),
    written by any strategy at any world size; the run goes on from the step after it."""
    async_save: bool = False
    """Write each checkpoint but the last while training goes on (DCP's `async_save`, on a gloo group of its
    own): the loop waits only for a copy of this rank's pieces in host memory. design.md named the key
    `async`; that is a Python keyword, which no structured config's field can be, so it is DCP's name."""


@dataclass
class Config:
    task: TaskConfig = MISSING
    model: Any = MISSING
    """A model's node (a ModelConfig of its class's, or a YAML naming any class)."""
    data: Any = MISSING
    """A data source's node (synthetic, text, tokens)."""
    strategy: Any = MISSING
    """A strategy's spec (ddp_lab/spec/strategies/): its knobs, typed, composed from conf/strategy/NAME.yaml."""
    backend: BackendConfig = MISSING
    network: Any = MISSING
    """How the nodes are joined: host, or emulated nodes on this machine."""
    logger: LoggerConfig = MISSING
    world_size: int = 2
    """Total ranks, split over launcher.nnodes."""
    train: TrainConfig = field(default_factory=TrainConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The axes beyond data parallelism: tensor parallelism (spec/parallel.py); world_size = dp x tp."""
    profile: bool = False
    """torch.profiler traces of a few training steps, and the timeline picture."""
    resume: Optional[str] = None
    """A sweep or run folder: re-run its jobs that did not end ok."""


def data_parallel_size(cfg) -> int:
    """The ranks the global batch is split over: world_size / (parallel.tp x parallel.pp x parallel.cp)
    (tensor-parallel ranks read the same rows, and so do a pipeline's stages and context-parallel ranks, each its
    own tokens of them); a config without a `parallel` node (older results, the tests' own) is data parallel
    only."""
    return max(1, layout_of(cfg).dp)


def micro_batch_size(cfg) -> int:
    """Sequences in one forward of one rank: the global batch over the data-parallel ranks and the micro-batches
    (gradient accumulation's, or a pipeline's; at least 1)."""
    from ddp_lab.spec.pipeline import microbatches_of

    parallel = OmegaConf.select(cfg, "parallel")
    pp_micro = microbatches_of(parallel) if parallel is not None else 1
    return max(1, cfg.train.batch_size // data_parallel_size(cfg) // cfg.train.grad_accum_steps // pp_micro)


def register_configs() -> None:
    """Make the schema visible to Hydra as `base_config` (conf/config.yaml lists it first), each model
    class's node as `schema/model/NAME` and each strategy's spec as `spec/strategy/NAME` (their YAMLs in
    conf/model/ and conf/strategy/ list them in their defaults)."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    for name, node in MODEL_SCHEMAS.items():
        store.store(group="schema/model", name=name, node=node)
    for name, node in DATA_SCHEMAS.items():
        store.store(group="schema/data", name=name, node=node)
    for name, node in NETWORK_SCHEMAS.items():
        store.store(group="schema/network", name=name, node=node)
    register_strategy_specs(store)


NOT_ARGUMENTS = ("_target_", "name")


def set_knobs(node) -> dict[str, Any]:
    """The keys of a model node that are constructor arguments and set (not None)."""
    return {k: node[k] for k in node if k not in NOT_ARGUMENTS and node[k] is not None}


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose_model(name: str, overrides: dict | None = None) -> DictConfig:
    """conf/model/NAME.yaml composed on its class's node with `overrides` (key: value), as launch.py would
    compose it, for tools that run outside launch.py (the calculator, `predict scale`); ValueError for an
    unknown name or key."""
    from hydra import compose, initialize_config_dir

    options = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
    if name not in options:
        raise ValueError(f"unknown model {name!r}; options: {', '.join(options)}")
    register_configs()
    args = [f"model={name}"] + [f"model.{key}={value}" for key, value in (overrides or {}).items()]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose("config", overrides=args).model
    except Exception as exc:  # Hydra's composition errors: a key the model does not have, a wrong type
        raise ValueError(f"model={name} with {overrides}: {str(exc).splitlines()[0]}") from None


def key_values(items: list[str], flag: str) -> dict[str, Any]:
    """`KEY=VALUE` items of a command-line flag (`--set`, `--knob`), each value read as YAML (10 -> int,
    1e-3 -> float, true -> bool, fp16 -> str); ValueError naming the flag for an item without `=`."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} takes KEY=VALUE, got {item!r}")
        out[key] = yaml.safe_load(value)
    return out


def build(node: DictConfig, *args, **kwargs) -> Any:
    """Instantiate a model node: `_target_(*args, **set_knobs(node), **kwargs)`."""
    args_node = OmegaConf.masked_copy(node, ["_target_", *set_knobs(node)])
    return instantiate(args_node, *args, **kwargs)
