"""task=train: train the chosen model with the chosen strategy and measure every step.

The loop reads top to bottom and never names a strategy: the strategy object wraps the model and
builds the optimizer, and the wrapper's `finish_gradient_synchronization()` / `no_sync()` are the
only synchronization points it knows.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.utils import instantiate

from ddp_lab.data import rank_micro_batches
from ddp_lab.distributed import seed_everything
from ddp_lab.faults import maybe_inject_fault
from ddp_lab.memory import expected_zero_bytes, is_sharded, model_state_bytes
from ddp_lab.models import build_model
from ddp_lab.profiling import StepProfiler
from ddp_lab.run_recorder import run_name
from ddp_lab.stats import summarize
from ddp_lab.step_metrics import StepTimer, reduce_over_ranks

# A step's phases (timer laps): fwd_bwd (zero_grad, batch, forward, backward), sync, optimizer.
SUMMARIZED = ("step_time_ms", "comm_ms", "exposed_comm_ms", "exposed_optimizer_comm_ms", "fwd_bwd_ms", "sync_ms",
              "optimizer_ms")


def run(cfg, device: torch.device, recorder, job_dir) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seed_everything(cfg.train.seed + rank)  # different init per rank: the strategy's broadcast must fix it
    strategy = instantiate(cfg.strategy)
    model = strategy.wrap(build_model(cfg.model).to(device))
    optimizer = strategy.build_optimizer([p for p in model.parameters() if p.requires_grad], torch.optim.AdamW,
                                         lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    recorder.log_once(run_facts(model))
    memory = {"after_init": memory_snapshot(model, optimizer, device)}
    timer, steps = StepTimer(device), []
    recorder.start(cfg.train.steps)
    with StepProfiler(cfg, job_dir, device, label=run_name(cfg)) as profiler:  # no-op unless profile=true
        for step in range(cfg.train.steps):
            maybe_inject_fault(cfg.fault, rank, step)
            timer.start()
            optimizer.zero_grad(set_to_none=True)
            micro_batches = list(rank_micro_batches(step, cfg, rank, world_size, device))
            loss_sum = torch.zeros((), device=device)
            for i, (inputs, targets) in enumerate(micro_batches):
                last = i == len(micro_batches) - 1
                with nullcontext() if last else model.no_sync():
                    logits = model(inputs)
                    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / len(micro_batches)
                    loss.backward()
                loss_sum += loss.detach()
            timer.lap("fwd_bwd_ms")
            model.finish_gradient_synchronization()
            timer.lap("sync_ms")
            if step == cfg.train.steps - 1:  # optimizer state exists from the first step on
                memory["before_step"] = memory_snapshot(model, optimizer, device)
            optimizer.step()
            timer.lap("optimizer_ms")
            step_ms = timer.stop_ms()
            if step == cfg.train.steps - 1:
                memory["after_step"] = memory_snapshot(model, optimizer, device)
            record = {"step": step, **reduce_over_ranks(
                {"step_time_ms": step_ms, "loss": loss_sum.item(), **timer.laps, **model.comm.pop()}, device)}
            steps.append(record)
            recorder.step(record)
            profiler.step()
    if cfg.train.save_model and rank == 0:
        torch.save(model.module.state_dict(), job_dir / "model.pt")
    summary = summarize_steps(steps, cfg.train.warmup_steps)
    summary["memory"] = memory_report(memory, model, optimizer)
    summary["trace_overlap"] = profiler.overlap  # None unless profile=true
    return {"summary": summary, "steps": steps}


def run_facts(model) -> dict:
    """Once per run: model size and, for bucketed wrappers, the bucket plan."""
    facts = {"num_params": sum(p.numel() for p in model.parameters())}
    if hasattr(model, "bucket_sizes_mb"):
        facts["buckets"] = {"count": len(model.bucket_sizes_mb), "sizes_mb": list(model.bucket_sizes_mb)}
    return facts


def memory_snapshot(model, optimizer, device) -> dict:
    """This rank's model-state bytes now; on CUDA also the allocator's peak so far."""
    snapshot = model_state_bytes(model, optimizer)
    if device.type == "cuda":
        snapshot["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
    return snapshot


def memory_report(memory: dict, model, optimizer) -> dict:
    """Every rank's three snapshots (gathered once, at the end) beside the ZeRO paper's figures."""
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, memory)
    num_params = sum(p.numel() for p in model.parameters())
    stage = 1 if is_sharded(optimizer) else 0
    expected = expected_zero_bytes(num_params, 4, dist.get_world_size(), stage)
    return {"per_rank": per_rank, "zero_stage": stage, "expected": expected,
            "optimizer_state_max_rank": max(r["after_step"]["optimizer_state"] for r in per_rank)}


def summarize_steps(steps: list[dict], warmup_steps: int) -> dict:
    """Summaries over the measured (post-warm-up) steps, plus overlap % where comm was in flight."""
    measured = [s for s in steps if s["step"] >= warmup_steps]
    summary = {key: summarize(s.get(key) for s in measured) for key in SUMMARIZED}
    total = sum(s.get("comm_ms", 0.0) for s in measured)
    exposed = sum(s.get("exposed_comm_ms", 0.0) for s in measured)
    summary["overlap_pct"] = max(0.0, 100.0 * (1.0 - exposed / total)) if total > 0 else None
    summary["measured_steps"] = len(measured)
    if measured:
        summary["collectives_per_step"] = measured[-1].get("collectives")
        summary["comm_bytes_per_step"] = measured[-1].get("comm_bytes")
    return summary
