"""Bytes per rank under the ZeRO stages, and bytes on each rank's link per step: the one home of these
figures (the calculator's rows, the trainer's expected memory in rank/memory.py, the launcher's
memory estimate and the report's measured-vs-paper table all call them)."""

from __future__ import annotations

# Bytes per parameter: (params, grads, optimizer state) for Adam.
# fp32: weights 4, grads 4, Adam m and v 4 + 4.
# bf16 or fp16 (mixed precision, ZeRO paper section 3.1, which used fp16): 16-bit weights 2,
# 16-bit grads 2, and an fp32 master copy of the weights plus m and v, 12 bytes ("K = 12"):
# 16 bytes per parameter in all.
DTYPE_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}


def model_state_bytes(n_params: int, dtype: str = "bf16", world_size: int = 1, stage: int = 0) -> dict:
    """Bytes of params, grads and optimizer state on one device under ZeRO stage 0-3 over N ranks.

    Stage 1 shards optimizer state, 2 also gradients, 3 also parameters (ZeRO paper, figure 1).
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; options: {', '.join(DTYPE_BYTES)}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
    p, g, o = (b * n_params for b in DTYPE_BYTES[dtype])
    n = world_size
    out = {"params": p / n if stage >= 3 else p,
           "grads": g / n if stage >= 2 else g,
           "optimizer": o / n if stage >= 1 else o}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
