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


def comm_bytes_per_step(n_params: int, dtype: str = "bf16", world_size: int = 1, strategy: str = "ddp") -> float:
    """Bytes over each rank's link per step (nccl-tests bus convention: bytes / busbw = time).

    ddp, zero2: all-reduce gradients, 2(N-1)/N * G.
    zero1: reduce-scatter gradients + all-gather updated params, (N-1)/N * (G + P): the same as
      one all-reduce when params and grads share a dtype (ZeRO: no extra volume).
    zero1_cs336: all-reduce gradients, then every rank broadcasts the parameters it updated:
      2(N-1)/N * G + P (a broadcast's bus factor is 1).
    zero3: all-gather params in forward and again in backward, reduce-scatter grads:
      (N-1)/N * (2P + G), 1.5x ddp.
    """
    p_b, g_b, _ = DTYPE_BYTES[dtype]
    P, G, n = p_b * n_params, g_b * n_params, world_size
    if n == 1:
        return 0.0
    volumes = {"ddp": 2 * (n - 1) / n * G, "zero2": 2 * (n - 1) / n * G,
               "zero1": (n - 1) / n * (G + P), "zero1_cs336": 2 * (n - 1) / n * G + P,
               "zero3": (n - 1) / n * (2 * P + G)}
    if strategy not in volumes:
        raise ValueError(f"unknown strategy {strategy!r}; options: {', '.join(volumes)}")
    return volumes[strategy]
