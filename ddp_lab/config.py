"""The typed schema of every config group.

Hydra merges each group's YAML into these dataclasses, so a wrong type (`train.lr=abc`) or an unknown
key (`train.stepz=3`) is refused by Hydra itself before launch.py runs a line of its own. Checks
that need more than a type (world_size > 0, batch divisible by ranks, memory) live in validate.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class LoggerMode(str, Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


class FaultKind(str, Enum):
    none = "none"
    crash = "crash"
    hang = "hang"
    oom = "oom"


@dataclass
class TaskConfig:
    name: str = "train"
    # task=allreduce only: the collective benchmark's knobs.
    op: str = "all_reduce"
    size_mb: float = 10.0
    iters: int = 20
    warmup_iters: int = 5
    time_budget_s: float = 120.0  # caps iters so a huge message still ends in minutes


@dataclass
class ModelConfig:
    _target_: str = MISSING
    name: str = MISSING
    vocab_size: int = 10000
    context_length: int = 128
    d_model: int = 768
    d_ff: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    rope_theta: float = 10000.0


@dataclass
class StrategyConfig:
    """`wrapper` and `optimizer` are partials Hydra instantiates; the rest are the knobs users sweep."""

    _target_: str = "ddp_lab.strategies.Strategy"
    name: str = MISSING
    wrapper: Any = MISSING
    optimizer: Any = None
    bucket_mb: Optional[float] = None
    grad_sync: Optional[str] = None
    comm: Optional[str] = None


@dataclass
class BackendConfig:
    name: str = "auto"
    timeout_s: float = 300.0


@dataclass
class TrainConfig:
    steps: int = 20
    warmup_steps: int = 3
    batch_size: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0
    grad_accum_steps: int = 1
    save_model: bool = False  # rank 0 writes the final weights to JOB_DIR/model.pt


@dataclass
class LoggerConfig:
    name: str = "wandb"
    mode: LoggerMode = LoggerMode.offline
    project: str = "ddp-lab"
    entity: Optional[str] = None
    group: Optional[str] = None


@dataclass
class LauncherConfig:
    """torchrun's own (static) rendezvous: world_size ranks split evenly over nnodes.

    node_rank 0 hosts the rendezvous at rdzv_endpoint (HOST:PORT) and global rank 0. Under a
    submitit launcher (SLURM) node_rank and rdzv_endpoint come from the job's environment.
    """

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: Optional[str] = None
    # Last resort after backend.timeout_s: stop a job still running after this many seconds
    # (0 = never). For what no collective timeout sees: every rank stuck outside a collective.
    watchdog_s: float = 0.0


@dataclass
class FaultConfig:
    """Make a rank fail on purpose at a step (ddp_lab/faults.py); rank=-1 means every rank."""

    kind: FaultKind = FaultKind.none
    rank: int = 0
    step: int = 0


@dataclass
class Config:
    task: TaskConfig = MISSING
    model: ModelConfig = MISSING
    strategy: StrategyConfig = MISSING
    backend: BackendConfig = MISSING
    logger: LoggerConfig = MISSING
    world_size: int = 2
    train: TrainConfig = field(default_factory=TrainConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    profile: bool = False
    resume: Optional[str] = None


def register_configs() -> None:
    """Make the schema visible to Hydra as `base_config` (conf/config.yaml lists it first)."""
    ConfigStore.instance().store(name="base_config", node=Config)
