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

Those three are the ZeRO paper's model state. Beside them, `strategy_state` counts every byte a
strategy keeps from one step to the next beyond them (`model.kept_tensors()`, strategies/base.py:
bucketed's and DDP's gradient buckets, zero2's pooled buckets, PowerSGD's error feedback, Q and send
buffers, local SGD's anchor and outer momentum), each storage once and none that already holds a
parameter, gradient or optimizer state (bucketed's gradients *are* its bucket slices). Activations
and the buffers of a collective in flight are not kept between steps; fsdp reports the peak of
what it gathered at once as `peak_gathered_bytes`, FSDP2 under a pipeline what it holds whole through the step
(`unsharded_bytes`: the gathered parameters and the gradients accumulated whole, before its one reduction), and on
CUDA `torch.cuda.max_memory_allocated` covers everything. After the last step the snapshot also takes a
census, `live_tensor_bytes`: every tensor storage alive in the process, found through the garbage collector, each
once. It is what the accounting must explain (tests/parity/test_memory_census.py holds every strategy to it).

The expected figures follow what the implementation keeps. Under autocast (train.precision bf16 or
fp16) parameters, gradients and AdamW's moments all stay fp32 here, and fsdp's compute dtype casts
only the gathered copies, so the figure is fp32's 4 + 4 + 8 bytes per parameter at every
precision. In mixed precision the ZeRO paper's 2 + 2 + 12 (fp16 weights and gradients, fp32
master copy and moments; section 3.1 / figure 1) is recorded beside it as `paper_mixed`. Both
come from one function, ddp_lab/arithmetic/zero_bytes.py's `model_state_bytes` (the calculator's
rows and the report's "measured vs ZeRO paper" table use it too): stage 1 divides the optimizer
state by N, stage 2 also the gradients, stage 3 also the parameters.
"""

from __future__ import annotations

import gc
import re
import sys

import torch
import torch.distributed as dist

from ddp_lab.arithmetic import zero_bytes
from ddp_lab.units import tensor_bytes

KEYS = ("params", "grads", "optimizer_state")
STATE_DTYPE = "fp32"  # parameters, gradients and optimizer state are fp32 at every train.precision here
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
    """numel x element size of the tensors in `obj` (nested dicts/lists/tuples too), local shards only, each
    tensor once."""
    return sum(tensor_bytes(t) for t in {id(t): t for t in _tensors(obj)}.values())


def is_sharded(optimizer) -> bool:
    """True for optimizers that keep only this rank's shard of the state in an inner `.optim`
    (ShardedOptimizer, Zero2Optimizer, torch's ZeroRedundancyOptimizer)."""
    return isinstance(getattr(optimizer, "optim", None), torch.optim.Optimizer)


def local_optimizer(optimizer):
    """The optimizer that holds this rank's state: a sharded optimizer's inner `.optim`, else itself."""
    return optimizer.optim if is_sharded(optimizer) else optimizer


def inner_optimizers(optimizer) -> list:
    """The torch optimizers `optimizer` holds, under any attribute name, alone or in a list, tuple or dict (a
    course's sharded optimizer keeps its inner one as `optimizer`, `_local_optimizer`, `wrapped_optimizers`...),
    itself excluded."""
    found = []
    for value in vars(optimizer).values():
        items = value if isinstance(value, (list, tuple)) else value.values() if isinstance(value, dict) else [value]
        for item in items:
            if isinstance(item, torch.optim.Optimizer) and item is not optimizer and all(item is not f for f in found):
                found.append(item)
    return found


def local_optimizer_state(optimizer) -> list:
    """The per-parameter state this rank really holds: the optimizer's own and every inner optimizer's, each
    state dict once (a wrapper whose `state` is its inner optimizer's is not counted twice)."""
    states, seen = [], set()
    for holder in [optimizer, *inner_optimizers(optimizer)]:
        state = getattr(holder, "state", None)
        if isinstance(state, dict) and id(state) not in seen:
            seen.add(id(state))
            states.extend(state.values())
    return states


def _tensors(obj) -> list[torch.Tensor]:
    """The tensors in `obj` (nested dicts/lists/tuples too), local shards only."""
    if torch.is_tensor(obj):
        return [local(obj)]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def storage_key(tensor: torch.Tensor) -> tuple | None:
    """What identifies a tensor's storage (device, address); None for one without memory of its own."""
    if tensor.device.type == "meta":
        return None
    try:
        storage = tensor.untyped_storage()
        return (tensor.device, storage.data_ptr()) if storage.nbytes() else None
    except (RuntimeError, NotImplementedError):  # a wrapper subclass (DTensor) has none: its local tensor does
        return None


def model_state_storages(model: torch.nn.Module, optimizer=None) -> dict:
    """{"params", "grads", "optimizer_state"}: {storage key: bytes} of the storages behind each figure, each
    counted once and whole: what they cost in memory, where `model_state_bytes` counts elements (a shard that is a
    view of the whole weight holds all of it alive; ddp_lab.check measures what a rank holds by this)."""
    return {key: _storages(_tensors(tensors)) for key, tensors in _model_state_tensors(model, optimizer).items()}


def strategy_state_bytes(model, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of the storages a strategy (strategies/base.py's contract) keeps between steps
    (`model.kept_tensors()`) that hold no parameter, gradient or optimizer state: each storage counted
    once, whole."""
    kept = model.kept_tensors()
    held = {storage_key(t) for t in _tensors(_model_state_tensors(model, optimizer))}
    return _storage_bytes(_tensors(kept), skip=held)


def _storages(tensors, skip: set = frozenset()) -> dict:
    """{storage key: bytes} of the distinct storages behind `tensors`, each whole and once, but those in `skip`."""
    return {key: t.untyped_storage().nbytes() for t in tensors
            if (key := storage_key(t)) is not None and key not in skip}


def _storage_bytes(tensors, skip: set = frozenset()) -> int:
    """Bytes of the distinct storages behind `tensors`, each whole and once, but those in `skip`."""
    return sum(_storages(tensors, skip).values())


def live_tensor_bytes() -> int:
    """Every tensor storage alive in this process (found through the garbage collector, each once), bytes.

    The census the accounting is checked against: it sees what no strategy reports, so a test can
    hold the reported figures to it. `issubclass(type(...))`, not `isinstance`: the latter reads
    `__class__`, which some of torch's deprecated module attributes answer with a warning. The fake tensors
    torch.compile's tracing leaves alive (train.compile) hold no memory and are passed over (reading their
    address is deprecated).
    """
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    return _storage_bytes(obj for obj in gc.get_objects()
                          if issubclass(type(obj), torch.Tensor) and not issubclass(type(obj), FakeTensor))


def _model_state_tensors(model: torch.nn.Module, optimizer) -> dict:
    """{"params", "grads", "optimizer_state"}: the tensors behind each figure (see module doc)."""
    # a DeepSpeed ZeRO-3 parameter holds its partition (`ds_tensor`) and, while gathered or small enough to
    # stay whole (stage3_param_persistence_threshold), its full data too (empty when released)
    params = [t for p in model.parameters() for t in ((p.ds_tensor, p) if hasattr(p, "ds_tensor") else (p,))]
    updated = [p for g in local_optimizer(optimizer).param_groups for p in g["params"]] if optimizer else []
    seen, grads = set(), []
    for p in params + updated:
        if id(p) not in seen and p.grad is not None:
            grads.append(p.grad)
        seen.add(id(p))
    state = local_optimizer_state(optimizer) if optimizer is not None else []
    return {"params": params, "grads": grads, "optimizer_state": state}


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """{"params", "grads", "optimizer_state"}: bytes this rank holds for each (see module doc)."""
    return {key: _tensor_bytes(tensors) for key, tensors in _model_state_tensors(model, optimizer).items()}


def expected_zero_bytes(num_params: int, dtype, world_size: int, stage: int) -> dict:
    """The ZeRO paper's per-device model-state bytes: {"params", "grads", "optimizer_state"}.

    `dtype`: "fp32" (or 4): fp32 training with Adam, 4 + 4 + 8 bytes per parameter (m and v, no
    master copy); "bf16"/"fp16" (or 2): mixed precision as in the paper, 2 + 2 + 12 (K = 12: fp32
    master weights, m, v). Stage 0 is plain data parallelism. Fractions are kept (no rounding):
    the paper's figure divides exactly, and a real shard can only approximate it.
    """
    name = {4: "fp32", 2: "bf16"}.get(dtype, dtype)
    if name not in zero_bytes.DTYPE_BYTES:
        raise ValueError(f"dtype must be fp32 (4), bf16 or fp16 (2: mixed precision), got {dtype!r}")
    out = zero_bytes.model_state_bytes(num_params, name, world_size, stage)
    return {"params": out["params"], "grads": out["grads"], "optimizer_state": out["optimizer"]}


def memory_snapshot(model, optimizer, device: torch.device, census: bool = False) -> dict:
    """This rank's model-state bytes now, what the strategy (strategies/base.py's contract) keeps beside
    them; fsdp's peak of gathered parameters so far; on CUDA the allocator's peak so far; with `census`,
    every live storage's bytes."""
    snapshot = model_state_bytes(model, optimizer)
    snapshot["strategy_state"] = strategy_state_bytes(model, optimizer)
    if census:
        snapshot["live_tensor_bytes"] = live_tensor_bytes()
    if model.peak_gathered_bytes is not None:
        snapshot["peak_gathered_bytes"] = int(model.peak_gathered_bytes)
    if getattr(model, "unsharded_bytes", None) is not None:
        snapshot["unsharded_bytes"] = int(model.unsharded_bytes)
    if device.type == "cuda":
        snapshot["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
    return snapshot


def host_peak_from_now() -> int | None:
    """Start this process's peak resident memory afresh (Linux: writing 5 to /proc/self/clear_refs sets VmHWM
    to VmRSS) and return the resident bytes now; None where the kernel offers neither (no /proc)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _proc_status_bytes("VmRSS")
    except OSError:
        return None


def host_peak_bytes() -> int | None:
    """This process's peak resident memory since `host_peak_from_now()` (VmHWM); None without /proc."""
    try:
        return _proc_status_bytes("VmHWM")
    except OSError:
        return None


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE).group(1)) * 1024


def model_state(snapshot: dict) -> int:
    return sum(snapshot[k] for k in KEYS)


def summarize_memory(per_rank: list[dict], num_params: int, world_size: int, stage: int,
                     precision: str = "fp32") -> dict:
    """Every rank's snapshots beside the expected figures for `stage`, and the bar's ratio.

    A rank's model state is the largest params + grads + optimizer state of its three points (in
    practice before the last step, when all three are held); its `state_total` the largest model
    state + strategy_state, and `strategy_state` the latter's part there; where the strategy held whole copies
    through a step (`unsharded_bytes`), `state_total` is at least the shards' parameters, optimizer state and kept
    state with those copies (`state_total_at`: "before_reduction"). `model_state_ratio` = the
    largest rank's model state / the expected figure for the stage (fp32 state, module doc): 1.0
    when the shards are exactly 1/N, above it by padding, whole-parameter shards or state the
    paper does not count (Adam's step counters). `precision` bf16/fp16 adds the paper's mixed
    precision figures (`paper_mixed`, `paper_mixed_total`) beside them.
    """
    expected = expected_zero_bytes(num_params, STATE_DTYPE, world_size, stage)
    full = expected_zero_bytes(num_params, STATE_DTYPE, world_size, 0)
    expected_total, full_total = sum(expected.values()), sum(full.values())
    for snapshots in per_rank:
        points = {p: snapshots[p] for p in POINTS if p in snapshots}
        at = max(points, key=lambda p: model_state(points[p]))
        snapshots["model_state"] = model_state(points[at])
        snapshots["model_state_at"] = at
        snapshots["model_state_ratio"] = snapshots["model_state"] / expected_total
        kept_at = max(points, key=lambda p: model_state(points[p]) + points[p].get("strategy_state", 0))
        snapshots["strategy_state"] = points[kept_at].get("strategy_state", 0)
        snapshots["state_total"] = model_state(points[kept_at]) + snapshots["strategy_state"]
        snapshots["state_total_at"] = kept_at
        whole = max((points[p].get("unsharded_bytes", 0) for p in points), default=0)
        if whole and "before_step" in points:  # the shards' parameters and optimizer state, and the whole copies
            at_peak = (points["before_step"]["params"] + points["before_step"]["optimizer_state"]
                       + points["before_step"].get("strategy_state", 0) + whole)
            if at_peak > snapshots["state_total"]:
                snapshots["state_total"], snapshots["state_total_at"] = at_peak, "before_reduction"
    largest = max(per_rank, key=lambda s: s["model_state"])
    out = {"per_rank": per_rank, "zero_stage": stage, "dtype": STATE_DTYPE, "precision": precision,
           "num_params": num_params, "expected": expected, "expected_total": expected_total, "full": full,
           "full_total": full_total, "zero_fraction": expected_total / full_total,
           "model_state_max_rank": largest["model_state"],
           "model_state_max_rank_parts": {k: largest[largest["model_state_at"]][k] for k in KEYS},
           "model_state_ratio": largest["model_state"] / expected_total,
           "optimizer_state_max_rank": max(s["after_step"]["optimizer_state"] for s in per_rank),
           "strategy_state_max_rank": max(s["strategy_state"] for s in per_rank),
           "state_total_max_rank": max(s["state_total"] for s in per_rank)}
    if precision != STATE_DTYPE:
        out["paper_mixed"] = expected_zero_bytes(num_params, precision, world_size, stage)
        out["paper_mixed_total"] = sum(out["paper_mixed"].values())
    for key in ("peak_gathered_bytes", "unsharded_bytes", "max_memory_allocated", "live_tensor_bytes"):
        values = [s[p][key] for s in per_rank for p in POINTS if key in s.get(p, {})]
        if values:
            out[f"{key}_max_rank"] = max(values)
    return out


def memory_report(memory: dict, zero_stage: int, num_params: int, precision: str = "fp32",
                  shard_ranks: int | None = None, whole_params: int | None = None) -> dict:
    """Every rank's snapshots (gathered once, at the end), summarized by `summarize_memory`.
    `num_params`: the count a rank holds before its strategy shards (taken before wrapping: fsdp's parameters are
    shards): the whole model's, or under tensor parallelism its pieces'; `whole_params`: the whole model's, where
    that differs (the report then says the TP fraction: each rank's pieces over the whole, padding included);
    `shard_ranks`: how many ranks share what is sharded (hsdp: its shard group; default: every rank);
    `memory["activations"]`: the rank's activation peak (rank/activations.py), beside the model state."""
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, memory)
    report = summarize_memory(per_rank, num_params, shard_ranks or dist.get_world_size(), zero_stage, precision)
    report["shard_ranks"] = shard_ranks or dist.get_world_size()
    counted = [m.get("activations") for m in per_rank]
    report["activation_peak_bytes"] = counted  # per rank: rank/activations.py's count (None: not counted)
    report["activation_peak_bytes_max_rank"] = max((c for c in counted if c is not None), default=None)
    if whole_params is not None and whole_params != num_params:
        report["whole_params"] = whole_params
        report["tp_param_fraction"] = num_params / whole_params
    return report
