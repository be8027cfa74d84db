"""task=allreduce: time one collective (`task.op`) across the job's ranks, nccl-tests style.

Every rank runs the same loop (`collectives.benchmark_collective`: warm-up, a barrier before each
iteration, the device synchronized around each call). The per-rank times are gathered and each
iteration is billed at its slowest rank, because a collective is done only when its last rank is.

A 1 GiB message on a loaded CPU box can take seconds per call, so after the warm-up one probe
call decides how many timed iterations fit in `task.time_budget_s` (every rank uses the slowest
rank's probe, so all agree), never fewer than MIN_ITERS: a job takes minutes, not hours.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_lab.collectives import GB, MiB, algbw, benchmark_collective, busbw, combine_rank_times, summarize_collective

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
    probe = benchmark_collective(task.op, nbytes, iters=1, warmup=task.warmup_iters, device=device)
    iters = planned_iters(task.iters, slowest(probe[0], device), task.time_budget_s)
    info: dict = {}
    mine = benchmark_collective(task.op, nbytes, iters=iters, warmup=0, device=device, info=info)
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, mine)
    times = combine_rank_times(per_rank)

    summary = summarize_collective(task.op, info["bytes"], world_size, times)
    summary.update(backend=dist.get_backend(), device=device_name(device), size_mb=task.size_mb,
                   api=info["api"], iters_requested=task.iters, warmup_iters=task.warmup_iters,
                   time_budget_s=task.time_budget_s)
    steps = []
    for i, seconds in enumerate(times):
        ranks = [r[i] for r in per_rank]
        record = {"step": i, "latency_ms": seconds * 1e3,
                  "algbw_GBps": algbw(info["bytes"], seconds) / GB,
                  "busbw_GBps": busbw(task.op, info["bytes"], seconds, world_size) / GB,
                  "rank_spread_ms": (max(ranks) - min(ranks)) * 1e3}
        steps.append(record)
        recorder.step(record)
    return {"summary": summary, "steps": steps}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
