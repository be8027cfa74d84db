"""Checks on a composed config that Hydra's types cannot express, run before any rank starts.

Each failure is a `ConfigError` whose message is one line saying what to change; launch.py prints
it and exits 2. Types and unknown keys are refused earlier by Hydra against ddp_lab/config.py.
"""

from __future__ import annotations


import torch
from omegaconf import DictConfig

from ddp_lab.memory_estimate import estimate_rank_bytes, fmt_bytes, host_available_bytes

# Leave this share of the machine's free memory to the OS, Python and the launcher itself.
MEMORY_HEADROOM = 0.85


class ConfigError(ValueError):
    """A user's mistake in the config: reported as one line, never as a traceback."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: DictConfig) -> None:
    ws, nnodes = cfg.world_size, cfg.launcher.nnodes
    _require(ws >= 1, f"world_size must be a positive number of ranks, got {ws}")
    _require(nnodes >= 1, f"launcher.nnodes must be >= 1, got {nnodes}")
    _require(ws % nnodes == 0, f"world_size={ws} does not split evenly over launcher.nnodes={nnodes}")
    _require(0 <= cfg.launcher.node_rank < nnodes,
             f"launcher.node_rank={cfg.launcher.node_rank} must be in [0, {nnodes - 1}]")
    _require(nnodes == 1 or cfg.launcher.rdzv_endpoint,
             "launcher.nnodes > 1 needs launcher.rdzv_endpoint=HOST:PORT (the node_rank=0 machine)")
    _require(cfg.backend.timeout_s > 0, f"backend.timeout_s must be > 0 seconds, got {cfg.backend.timeout_s}")
    _validate_backend(cfg.backend.name, ws // nnodes)
    if cfg.task.name == "train":
        _validate_train(cfg)


def _validate_backend(name: str, local_ranks: int) -> None:
    _require(name in ("auto", "gloo", "nccl"), f"unknown backend '{name}': use auto, gloo or nccl")
    if name == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        _require(gpus >= local_ranks,
                 f"backend=nccl needs {local_ranks} CUDA GPUs on this node (one per rank), found {gpus}: "
                 "use backend=gloo or backend=auto")


def _validate_train(cfg: DictConfig) -> None:
    t, m, ws = cfg.train, cfg.model, cfg.world_size
    _require(t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
    _require(0 <= t.warmup_steps < t.steps,
             f"train.warmup_steps={t.warmup_steps} must be in [0, train.steps) so some steps are measured")
    _require(t.batch_size >= 1, f"train.batch_size must be >= 1, got {t.batch_size}")
    _require(t.batch_size % ws == 0,
             f"train.batch_size={t.batch_size} (global) does not divide by world_size={ws}: use a multiple of {ws}")
    _require(t.grad_accum_steps >= 1, f"train.grad_accum_steps must be >= 1, got {t.grad_accum_steps}")
    local = t.batch_size // ws
    _require(local % t.grad_accum_steps == 0,
             f"each rank's batch ({local}) does not divide into train.grad_accum_steps={t.grad_accum_steps} micro-batches")
    _require(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    _require(t.weight_decay >= 0, f"train.weight_decay must be >= 0, got {t.weight_decay}")
    _require(m.context_length >= 1, f"model.context_length must be >= 1, got {m.context_length}")
    for key in ("vocab_size", "d_model", "d_ff", "num_layers", "num_heads"):
        _require(m[key] >= 1, f"model.{key} must be >= 1, got {m[key]}")
    _require(m.d_model % m.num_heads == 0,
             f"model.d_model={m.d_model} does not divide by model.num_heads={m.num_heads}")
    bucket_mb = cfg.strategy.get("bucket_mb")
    _require(bucket_mb is None or bucket_mb > 0, f"strategy.bucket_mb must be > 0 MiB, got {bucket_mb}")
    _validate_memory(cfg)


def _validate_memory(cfg: DictConfig) -> None:
    """Refuse a model that cannot fit, instead of letting the kernel OOM-kill a rank mid-run."""
    per_rank = estimate_rank_bytes(cfg)
    local_ranks = cfg.world_size // cfg.launcher.nnodes
    on_gpu = cfg.backend.name == "nccl" or (cfg.backend.name == "auto" and torch.cuda.is_available()
                                            and torch.cuda.device_count() >= local_ranks)
    if on_gpu:
        need, have, where = per_rank, torch.cuda.get_device_properties(0).total_memory, "each GPU"
    else:
        need, have, where = per_rank * local_ranks, host_available_bytes(), "this machine's free memory"
    _require(need <= MEMORY_HEADROOM * have,
             f"model={cfg.model.name} needs about {fmt_bytes(per_rank)} per rank ({fmt_bytes(need)} in all), "
             f"more than {int(MEMORY_HEADROOM * 100)}% of {where} ({fmt_bytes(have)}): "
             "use a smaller model, fewer ranks per node, or a smaller batch/context")
