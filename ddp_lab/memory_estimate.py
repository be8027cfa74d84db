"""A pre-launch estimate of one rank's memory, so launch.py refuses what cannot fit.

Counts parameters exactly by building the model on the `meta` device (no memory used), then adds
fp32 gradients, AdamW's two state tensors (divided over ranks when the optimizer is sharded), one
gradient-sized communication buffer, and a rough activation term. Errs on the generous side: it
only has to tell 'fits' from 'will be OOM-killed'.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

FP32 = 4


def count_parameters(model_cfg: DictConfig) -> int:
    from ddp_lab.models import build_model

    with torch.device("meta"):
        model = build_model(model_cfg)
    return sum(p.numel() for p in model.parameters())


def activation_bytes(model_cfg: DictConfig, local_batch: int) -> int:
    """Saved activations for backward, fp32: ~34·d per token per layer plus attention scores and logits."""
    tokens = local_batch * model_cfg.context_length
    per_layer = tokens * (34 * model_cfg.d_model + 5 * model_cfg.num_heads * model_cfg.context_length)
    logits = 3 * tokens * model_cfg.vocab_size
    return FP32 * (model_cfg.num_layers * per_layer + logits)


def estimate_rank_bytes(cfg: DictConfig) -> int:
    n = count_parameters(cfg.model)
    sharded = cfg.strategy.get("optimizer") is not None
    optimizer_state = 2 * FP32 * n // (cfg.world_size if sharded else 1)
    model_state = FP32 * n + FP32 * n + optimizer_state + FP32 * n  # params, grads, Adam, comm buffer
    micro_batch = cfg.train.batch_size // cfg.world_size // cfg.train.grad_accum_steps
    return model_state + activation_bytes(cfg.model, micro_batch)


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); elsewhere, total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
