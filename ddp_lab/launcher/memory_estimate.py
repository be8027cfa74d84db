"""A pre-launch estimate of one rank's memory, so launch.py refuses what cannot fit.

The model state is spec/zero_bytes.py's (the parameter count of the model as built, fp32 AdamW,
divided over ranks as the strategy's ZeRO stage says), plus one gradient-sized communication buffer and a rough
activation term. Errs on the generous side: it only has to tell 'fits' from 'will be OOM-killed'.
"""

from __future__ import annotations

from omegaconf import DictConfig

from ddp_lab.spec.zero_bytes import model_state_bytes

FP32 = 4


def activation_bytes(model_cfg: DictConfig, local_batch: int) -> int:
    """Saved activations for backward, fp32: ~34·d per token per layer plus attention scores and logits."""
    tokens = local_batch * model_cfg.context_length
    per_layer = tokens * (34 * model_cfg.d_model + 5 * model_cfg.num_heads * model_cfg.context_length)
    logits = 3 * tokens * model_cfg.vocab_size
    return FP32 * (model_cfg.num_layers * per_layer + logits)


def estimate_rank_bytes(cfg: DictConfig, n: int, stage: int) -> int:
    """Bytes one rank needs for a model of `n` parameters (counted on the model built on the meta device)
    under a strategy of ZeRO stage `stage`."""
    model_state = model_state_bytes(n, "fp32", cfg.world_size, stage)["total"] + FP32 * n  # + a comm buffer
    micro_batch = cfg.train.batch_size // cfg.world_size // cfg.train.grad_accum_steps
    return int(model_state) + activation_bytes(cfg.model, micro_batch)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
