"""Model-state memory of one rank, measured, beside what the ZeRO paper's accounting expects.

`model_state_bytes(model, optimizer)` counts what this rank holds right now: parameter bytes
(`parameters()` lists a tied weight once), gradient bytes (those not None) and optimizer
state bytes (for a sharded optimizer, only this rank's shard: ShardedOptimizer's and torch
ZeroRedundancyOptimizer's inner `.optim`). Communication buffers and activations are not model
state and are left out; on CUDA `torch.cuda.max_memory_allocated` covers them.

`expected_zero_bytes(num_params, dtype_bytes, world_size, stage)` is the paper's per-device figure
(section 3.1 / figure 1): Psi parameters with K bytes of optimizer state each; stage 1 divides the
optimizer state by N, stage 2 also the gradients, stage 3 also the parameters. The arithmetic
lives in ddp_lab/analysis/calculator.py; this is its measured-vs-expected face, with the same keys
as `model_state_bytes`. `memory_snapshot` and `memory_report` are what the trainer records.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_lab.analysis import calculator
from ddp_lab.units import tensor_bytes

KEYS = ("params", "grads", "optimizer_state")


def _tensor_bytes(obj) -> int:
    """numel x element size of the tensors in `obj` (nested dicts/lists/tuples too)."""
    if torch.is_tensor(obj):
        return tensor_bytes(obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def is_sharded(optimizer) -> bool:
    """True for optimizers that keep only this rank's shard of the state in an inner `.optim`
    (ShardedOptimizer, torch's ZeroRedundancyOptimizer): ZeRO stage 1."""
    return isinstance(getattr(optimizer, "optim", None), torch.optim.Optimizer)


def local_optimizer_state(optimizer) -> dict:
    """The state this rank really holds: a sharded optimizer's inner `.optim`, else its own."""
    return (optimizer.optim if is_sharded(optimizer) else optimizer).state


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """{"params", "grads", "optimizer_state"}: bytes this rank holds for each (see module doc)."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = local_optimizer_state(optimizer) if optimizer is not None else {}
    return {"params": _tensor_bytes(params), "grads": _tensor_bytes(grads),
            "optimizer_state": _tensor_bytes(list(state.values()))}


def expected_zero_bytes(num_params: int, dtype_bytes: int, world_size: int, stage: int) -> dict:
    """The ZeRO paper's per-device model-state bytes: {"params", "grads", "optimizer_state"}.

    dtype_bytes=4: fp32 training with Adam, 4 + 4 + 8 bytes per parameter (m and v, no master
    copy); dtype_bytes=2: mixed precision as in the paper, 2 + 2 + 12 (K = 12: fp32 master
    weights, m, v). Stage 0 is plain data parallelism. Fractions are kept (no rounding): the
    paper's figure divides exactly, and a whole-parameter shard can only approximate it.
    """
    dtype = {4: "fp32", 2: "bf16"}.get(dtype_bytes)
    if dtype is None:
        raise ValueError(f"dtype_bytes must be 4 (fp32) or 2 (bf16/fp16 mixed precision), got {dtype_bytes}")
    out = calculator.model_state_bytes(num_params, dtype, world_size, stage)
    return {"params": out["params"], "grads": out["grads"], "optimizer_state": out["optimizer"]}


def memory_snapshot(model, optimizer, device: torch.device) -> dict:
    """This rank's model-state bytes now; on CUDA also the allocator's peak so far."""
    snapshot = model_state_bytes(model, optimizer)
    if device.type == "cuda":
        snapshot["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
    return snapshot


def memory_report(memory: dict, model, optimizer) -> dict:
    """Every rank's snapshots (gathered once, at the end) beside the ZeRO paper's figures."""
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, memory)
    num_params = sum(p.numel() for p in model.parameters())
    stage = model.zero_stage
    expected = expected_zero_bytes(num_params, 4, dist.get_world_size(), stage)
    return {"per_rank": per_rank, "zero_stage": stage, "expected": expected,
            "optimizer_state_max_rank": max(r["after_step"]["optimizer_state"] for r in per_rank)}
