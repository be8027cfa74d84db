"""task=allreduce: time one collective (`task.op`) across the job's ranks, nccl-tests style.

Every rank runs the same loop (`benchmark_collective`: warm-up, a barrier before each iteration,
outside the timed region, so one rank's late arrival is not billed as the others' collective time,
and the device synchronized around each call, since a host timer around an async launch measures
only the launch). `task.barrier=false` drops the barrier: calls then run back to back, each timed
from the end of the one before, which is what a strategy issuing blocking collectives one after
another (naive) pays, the ranks' drift and the backend's wake-up included. The per-rank times are
gathered and each iteration is billed at its slowest rank, because a collective is done only when
its last rank is (arithmetic/bandwidth.py does the arithmetic).

A 1 GiB message on a loaded CPU box can take seconds per call, so after the warm-up one probe
call decides how many timed iterations fit in `task.time_budget_s` (every rank uses the slowest
rank's probe, so all agree), never fewer than MIN_ITERS: a job takes minutes, not hours.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from ddp_lab.arithmetic.bandwidth import (
    OPS,
    algbw,
    busbw,
    combine_rank_times,
    message_numel,
    summarize_collective,
)
from ddp_lab.rank.process_group import synchronize
from ddp_lab.spec.figures import ALGBW, BUSBW, LATENCY, RANK_SPREAD
from ddp_lab.strategies.collectives import all_gather, broadcasts, collectives_in_use, reduce_scatter
from ddp_lab.strategies.rings import global_rank
from ddp_lab.units import GB, MiB

MIN_ITERS = 3


def planned_iters(requested: int, probe_s: float, budget_s: float) -> int:
    """Timed iterations: as requested unless they would overrun the budget; at least MIN_ITERS."""
    if probe_s <= 0:
        return requested
    return max(min(requested, MIN_ITERS), min(requested, int(budget_s // probe_s)))


def slowest(seconds: float, device: torch.device) -> float:
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def run(cfg, device: torch.device, recorder, job_dir) -> dict:
    task, world_size = cfg.task, dist.get_world_size()
    nbytes = int(task.size_mb * MiB)
    barrier = bool(task.barrier)
    probe = benchmark_collective(task.op, nbytes, iters=1, warmup=task.warmup_iters, device=device)
    iters = planned_iters(task.iters, slowest(probe[0], device), task.time_budget_s)
    info: dict = {}
    mine = benchmark_collective(task.op, nbytes, iters=iters, warmup=0, device=device, barrier=barrier, info=info)
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, mine)
    times = combine_rank_times(per_rank)

    summary = summarize_collective(task.op, info["bytes"], world_size, times)
    summary.update(backend=dist.get_backend(), device=device_name(device), size_mb=task.size_mb,
                   api=info["api"], collectives=collectives_in_use(), iters_requested=task.iters,
                   warmup_iters=task.warmup_iters, time_budget_s=task.time_budget_s, barrier=barrier)
    steps = []
    for i, seconds in enumerate(times):
        ranks = [r[i] for r in per_rank]
        record = {"step": i, LATENCY.key: seconds * 1e3,
                  ALGBW.key: algbw(info["bytes"], seconds) / GB,
                  BUSBW.key: busbw(task.op, info["bytes"], seconds, world_size) / GB,
                  RANK_SPREAD.key: (max(ranks) - min(ranks)) * 1e3}
        steps.append(record)
        recorder.step(record)
    return {"summary": summary, "steps": steps}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def resolve_collective(op: str, numel: int, device: torch.device, dtype=torch.float32,
                       group=None) -> tuple[Callable[[], None], str, dict]:
    """Buffers and a zero-argument callable running `op` once, plus the name of the API it uses.

    Tensor ("single") APIs are preferred: they move one contiguous buffer, as the strategies do.
    torch 2.13 deprecates `reduce_scatter_tensor`/`all_gather_into_tensor` in favour of
    `reduce_scatter_single`/`all_gather_single`, and its gloo supports all of them; older torch
    lacks the `_single` names and older gloo lacks the tensor forms, hence the fallbacks, tried
    once with a real call (an unsupported op raises on every rank alike, before any traffic).
    Reduce-scatter, all-gather and broadcast run what `backend.collectives` chooses
    (strategies/collectives.py): the lab's rings on gloo by default, the backend's own with `native`.
    The last resort for reduce-scatter is an all-reduce of the whole message (named
    `all_reduce_emulation`; its bus factor then is all-reduce's, so report it as such).
    Returns (run, api_name, buffers).
    """
    n = dist.get_world_size(group)
    if numel % n:
        raise ValueError(f"numel={numel} is not a multiple of world_size={n}; use message_numel")
    full = torch.zeros(numel, device=device, dtype=dtype)
    chunk = torch.zeros(numel // n, device=device, dtype=dtype)
    bufs = {"full": full, "chunk": chunk}

    if op == "all_reduce":
        candidates = [("all_reduce", lambda: dist.all_reduce(full, group=group))]
    elif op == "broadcast" and collectives_in_use(group) == "ring":  # the chain zero1's owners send along
        candidates = [("ring_broadcast", lambda: [work.wait() for work in broadcasts([full], [0], group=group)])]
    elif op == "broadcast":
        candidates = [("broadcast", lambda: dist.broadcast(full, src=global_rank(group, 0), group=group))]
    elif op == "reduce":  # what zero2 and fsdp issue on gloo, N of them, one to each rank
        candidates = [("reduce", lambda: dist.reduce(full, dst=global_rank(group, 0), group=group))]
    elif op in ("reduce_scatter", "all_gather") and collectives_in_use(group) == "ring":
        # backend.collectives: the lab's ring (gloo's default), what every sharding strategy runs on gloo
        if op == "reduce_scatter":
            candidates = [("ring_reduce_scatter", lambda: reduce_scatter(chunk, full, group=group))]
        else:
            candidates = [("ring_all_gather", lambda: all_gather(full, chunk, group=group))]
    elif op == "reduce_scatter":
        candidates = [(name, partial(getattr(dist, name), chunk, full, group=group))
                      for name in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, name)]
        candidates.append(("reduce_scatter", lambda: dist.reduce_scatter(chunk, list(full.chunk(n)), group=group)))
        candidates.append(("all_reduce_emulation", lambda: dist.all_reduce(full, group=group)))
    elif op == "all_gather":
        candidates = [(name, partial(getattr(dist, name), full, chunk, group=group))
                      for name in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, name)]
        candidates.append(("all_gather", lambda: dist.all_gather(list(full.chunk(n)), chunk, group=group)))
    else:
        raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(OPS)}")

    errors = []
    for name, run in candidates:
        try:
            run()
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            errors.append(f"{name}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            continue
        return run, name, bufs
    raise RuntimeError(f"{op} is not supported by backend {dist.get_backend(group)}: " + "; ".join(errors))


def benchmark_collective(op: str, nbytes: int, iters: int, warmup: int, device: torch.device,
                         dtype=torch.float32, group=None, barrier: bool = True,
                         info: dict | None = None) -> list[float]:
    """Time `iters` calls of `op` on `nbytes` (see `message_bytes`) after `warmup` untimed ones.

    The process group must already be initialized. Returns this rank's per-iteration seconds;
    gather them from every rank and combine with `combine_rank_times`. Pass a dict as `info` to
    learn the torch API that ran (`api`) and the bytes actually moved (`bytes`), for results.json.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    n = dist.get_world_size(group)
    numel = message_numel(nbytes, n, torch.empty((), dtype=dtype).element_size())
    run, api, _ = resolve_collective(op, numel, device, dtype, group)  # its trial call is warm-up 0
    if info is not None:
        info.update(api=api, bytes=numel * torch.empty((), dtype=dtype).element_size())
    for _ in range(max(warmup - 1, 0)):
        run()
    synchronize(device)
    times = []
    for _ in range(iters):
        if barrier:
            dist.barrier(group=group)
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times
