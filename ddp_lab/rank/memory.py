"""Model-state memory of one rank, measured, beside what the ZeRO paper's accounting expects.

`model_state_bytes(model, optimizer)` counts what this rank holds right now, for any strategy:

- params: `model.parameters()` (a tied weight is listed once). At rest that is the full model for
  stages 0-2, and the local shard for stage 3 (fsdp's `parameters()` are its shards; a DTensor,
  fsdp_torch's, counts its local shard, `to_local()`);
- grads: every `.grad` of those parameters and of the tensors the optimizer updates on this rank
  (a sharded optimizer's inner `.optim`: zero1's owned parameters, zero2's slices, which hold
  zero2's averaged gradient shard while the model's parameters hold none), each tensor once;
- optimizer_state: the optimizer's state on this rank (a sharded optimizer's inner `.optim`: only
  its shard; ShardedOptimizer, Zero2Optimizer and torch's ZeroRedundancyOptimizer have one).

Communication buffers, gathered parameters and activations are not model state and are left out;
fsdp reports the peak of what it gathered at once as `peak_gathered_bytes`, and on CUDA
`torch.cuda.max_memory_allocated` covers everything.

The expected figures are the ZeRO paper's (section 3.1 / figure 1), from one function,
ddp_lab/analysis/calculator.py's `model_state_bytes`, which the calculator's ddp/zero1/zero2/zero3
rows and the report's "measured vs ZeRO paper" table use too: Psi parameters; fp32 AdamW 4 + 4 + 8
bytes each, or in mixed precision (train.precision bf16/fp16) 2 + 2 + 12; stage 1 divides the
optimizer state by N, stage 2 also the gradients, stage 3 also the parameters.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ddp_lab.analysis import calculator
from ddp_lab.units import tensor_bytes

KEYS = ("params", "grads", "optimizer_state")
POINTS = ("after_init", "before_step", "after_step")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank holds: a DTensor's local shard, any other tensor itself.

    No DTensor exists unless its module was imported (by fsdp_torch), so the check does not import
    it: that would add a second or more to every rank's start.
    """
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor) else tensor


def _tensor_bytes(obj) -> int:
    """numel x element size of the tensors in `obj` (nested dicts/lists/tuples too), local shards only."""
    if torch.is_tensor(obj):
        return tensor_bytes(local(obj))
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def is_sharded(optimizer) -> bool:
    """True for optimizers that keep only this rank's shard of the state in an inner `.optim`
    (ShardedOptimizer, Zero2Optimizer, torch's ZeroRedundancyOptimizer)."""
    return isinstance(getattr(optimizer, "optim", None), torch.optim.Optimizer)


def local_optimizer(optimizer):
    """The optimizer that holds this rank's state: a sharded optimizer's inner `.optim`, else itself."""
    return optimizer.optim if is_sharded(optimizer) else optimizer


def local_optimizer_state(optimizer) -> dict:
    """The state this rank really holds."""
    return local_optimizer(optimizer).state


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """{"params", "grads", "optimizer_state"}: bytes this rank holds for each (see module doc)."""
    params = list(model.parameters())
    updated = [p for g in local_optimizer(optimizer).param_groups for p in g["params"]] if optimizer else []
    seen, grads = set(), []
    for p in params + updated:
        if id(p) not in seen and p.grad is not None:
            grads.append(p.grad)
        seen.add(id(p))
    state = local_optimizer_state(optimizer) if optimizer is not None else {}
    return {"params": _tensor_bytes(params), "grads": _tensor_bytes(grads),
            "optimizer_state": _tensor_bytes(list(state.values()))}


def expected_zero_bytes(num_params: int, dtype, world_size: int, stage: int) -> dict:
    """The ZeRO paper's per-device model-state bytes: {"params", "grads", "optimizer_state"}.

    `dtype`: "fp32" (or 4): fp32 training with Adam, 4 + 4 + 8 bytes per parameter (m and v, no
    master copy); "bf16"/"fp16" (or 2): mixed precision as in the paper, 2 + 2 + 12 (K = 12: fp32
    master weights, m, v). Stage 0 is plain data parallelism. Fractions are kept (no rounding):
    the paper's figure divides exactly, and a real shard can only approximate it.
    """
    name = {4: "fp32", 2: "bf16"}.get(dtype, dtype)
    if name not in calculator.DTYPE_BYTES:
        raise ValueError(f"dtype must be fp32 (4), bf16 or fp16 (2: mixed precision), got {dtype!r}")
    out = calculator.model_state_bytes(num_params, name, world_size, stage)
    return {"params": out["params"], "grads": out["grads"], "optimizer_state": out["optimizer"]}


def memory_snapshot(model, optimizer, device: torch.device) -> dict:
    """This rank's model-state bytes now; fsdp's peak of gathered parameters so far; on CUDA the
    allocator's peak so far."""
    snapshot = model_state_bytes(model, optimizer)
    if getattr(model, "peak_gathered_bytes", None) is not None:
        snapshot["peak_gathered_bytes"] = int(model.peak_gathered_bytes)
    if device.type == "cuda":
        snapshot["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
    return snapshot


def model_state(snapshot: dict) -> int:
    return sum(snapshot[k] for k in KEYS)


def summarize_memory(per_rank: list[dict], num_params: int, world_size: int, stage: int,
                     precision: str = "fp32") -> dict:
    """Every rank's snapshots beside the ZeRO paper's figures for `stage`, and the bar's ratio.

    A rank's model state is the largest params + grads + optimizer state of its three points (in
    practice before the last step, when all three are held). `model_state_ratio` = the largest
    rank's model state / the paper's figure for the stage (= full state x ZeRO fraction): 1.0
    when the shards are exactly 1/N, above it by padding, whole-parameter shards or state the
    paper does not count (Adam's step counters).
    """
    expected = expected_zero_bytes(num_params, precision, world_size, stage)
    full = expected_zero_bytes(num_params, precision, world_size, 0)
    expected_total, full_total = sum(expected.values()), sum(full.values())
    for snapshots in per_rank:
        points = {p: snapshots[p] for p in POINTS if p in snapshots}
        at = max(points, key=lambda p: model_state(points[p]))
        snapshots["model_state"] = model_state(points[at])
        snapshots["model_state_at"] = at
        snapshots["model_state_ratio"] = snapshots["model_state"] / expected_total
    largest = max(per_rank, key=lambda s: s["model_state"])
    out = {"per_rank": per_rank, "zero_stage": stage, "dtype": precision, "num_params": num_params,
           "expected": expected, "expected_total": expected_total, "full": full, "full_total": full_total,
           "zero_fraction": expected_total / full_total,
           "model_state_max_rank": largest["model_state"],
           "model_state_max_rank_parts": {k: largest[largest["model_state_at"]][k] for k in KEYS},
           "model_state_ratio": largest["model_state"] / expected_total,
           "optimizer_state_max_rank": max(s["after_step"]["optimizer_state"] for s in per_rank)}
    for key in ("peak_gathered_bytes", "max_memory_allocated"):
        values = [s[p][key] for s in per_rank for p in POINTS if key in s.get(p, {})]
        if values:
            out[f"{key}_max_rank"] = max(values)
    return out


def memory_report(memory: dict, model, num_params: int, precision: str = "fp32") -> dict:
    """Every rank's snapshots (gathered once, at the end), summarized by `summarize_memory`.
    `num_params`: the whole model's count (taken before wrapping: fsdp's parameters are shards)."""
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, memory)
    return summarize_memory(per_rank, num_params, dist.get_world_size(), model.zero_stage, precision)
