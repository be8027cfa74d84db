"""Fabricated job folders (results.json as the trainer and the benchmark write them), so the
report's logic is tested in milliseconds (tests/unit/test_report.py); and what its output is checked with."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from ddp_lab.arithmetic.bandwidth import summarize_collective

MiB = 2**20
PNG = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path, min_bytes: int = 10_000) -> None:
    assert path.exists(), path
    assert path.stat().st_size > min_bytes
    with open(path, "rb") as f:
        assert f.read(8) == PNG


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def _summary(p50: float) -> dict:
    return {"mean": p50, "std": 0.1 * p50, "p50": p50, "p90": 1.2 * p50, "p95": 1.3 * p50, "min": 0.9 * p50,
            "max": 1.5 * p50}


def write_job(folder: Path, results: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def memory_summary(num_params: int, world_size: int, stage: int, ratio: float = 1.0) -> dict:
    """summary.memory as the trainer writes it (fp32 AdamW), the largest rank holding `ratio` x the
    ZeRO paper's figure for `stage`, each part scaled alike (figures written out by hand, not by
    the code under test)."""
    n = world_size
    paper = {"params": 4 * num_params / (n if stage >= 3 else 1), "grads": 4 * num_params / (n if stage >= 2 else 1),
             "optimizer_state": 8 * num_params / (n if stage >= 1 else 1)}
    parts = {k: int(v * ratio) for k, v in paper.items()}
    return {"zero_stage": stage, "dtype": "fp32", "num_params": num_params, "expected": paper,
            "model_state_max_rank": sum(parts.values()), "model_state_max_rank_parts": parts,
            "model_state_ratio": sum(parts.values()) / sum(paper.values()),
            "optimizer_state_max_rank": parts["optimizer_state"]}


def train_results(strategy: str, bucket_mb=None, step_ms: float = 20.0, exposed_ms: float = 5.0,
                  status: str = "ok", world_size: int = 2, grad_bytes: int = 64 * MiB,
                  memory: dict | None = None) -> dict:
    cfg = {"task": {"name": "train"}, "model": {"name": "tiny"}, "world_size": world_size,
           "strategy": {"name": strategy, "bucket_mb": bucket_mb}, "backend": {"name": "gloo"}}
    if status != "ok":
        return {"status": status, "error": "rank 1: InjectedFault: injected crash at step 1", "config": cfg,
                "env": {"world_size": world_size}, "summary": {}, "steps": []}
    optimizer, compute = 2.0, step_ms - exposed_ms - 2.0
    summary = {"step_time_ms": _summary(step_ms), "comm_ms": _summary(exposed_ms * 1.5),
               "exposed_comm_ms": _summary(exposed_ms), "fwd_bwd_ms": _summary(compute),
               "sync_ms": _summary(exposed_ms), "optimizer_ms": _summary(optimizer), "overlap_pct": 33.3,
               "measured_steps": 5, "collectives_per_step": 3, "comm_bytes_per_step": grad_bytes,
               "memory": memory or {"optimizer_state_max_rank": 8 * MiB}}
    return {"status": "ok", "error": None, "config": cfg, "env": {"backend": "gloo", "world_size": world_size},
            "summary": summary, "steps": [{"step": i, "step_time_ms": step_ms} for i in range(6)]}


def collective_results(size_mb: float, overhead_s: float, bandwidth_Bps: float, world_size: int = 2,
                       op: str = "all_reduce", status: str = "ok", barrier: bool = True) -> dict:
    cfg = {"task": {"name": "allreduce", "op": op, "size_mb": size_mb, "barrier": barrier},
           "world_size": world_size, "backend": {"name": "gloo"}}
    if status != "ok":
        return {"status": status, "error": "rank 0: killed", "config": cfg, "env": {}, "summary": {}, "steps": []}
    nbytes = int(size_mb * MiB)
    t = overhead_s + nbytes / bandwidth_Bps
    summary = summarize_collective(op, nbytes, world_size, [t, t, t])
    summary.update(backend="gloo", device="cpu", size_mb=size_mb, barrier=barrier)
    return {"status": "ok", "error": None, "config": cfg, "env": {"backend": "gloo", "world_size": world_size},
            "summary": summary, "steps": [{"step": i, "latency_ms": t * 1e3} for i in range(3)]}


def bucket_sweep(root: Path, failed: bool = True) -> Path:
    """Three bucket sizes (the middle one fastest) and, optionally, a crashed fourth job."""
    for i, (mb, step) in enumerate([(1, 30.0), (25, 20.0), (100, 26.0)]):
        write_job(root / str(i), train_results("bucketed", bucket_mb=mb, step_ms=step, exposed_ms=step / 4))
    if failed:
        write_job(root / "3", train_results("bucketed", bucket_mb=400, status="failed"))
    return root


def collective_sweep(root: Path, overhead_s: float = 2e-3, bandwidth_Bps: float = 2e9,
                     world_sizes=(2, 4), failed: bool = True) -> Path:
    i = 0
    for ws in world_sizes:
        for mb in (1, 10, 100):
            write_job(root / str(i), collective_results(mb, overhead_s, bandwidth_Bps, world_size=ws))
            i += 1
    if failed:
        write_job(root / str(i), collective_results(1000, overhead_s, bandwidth_Bps, status="failed"))
    return root


LADDER = {"bucketed": (0, 1.0), "zero1": (1, 1.01), "zero2": (2, 1.02)}  # strategy: (ZeRO stage, x paper)
LADDER_PARAMS = 2**20  # 1 Mi parameters: fp32 AdamW's full state is 16 MiB


def ladder_sweep(root: Path) -> Path:
    """bucketed, zero1 and zero2 at 2 and 4 ranks with known memory figures, and a crashed zero2 job."""
    i = 0
    for ws in (2, 4):
        for strategy, (stage, ratio) in LADDER.items():
            memory = memory_summary(LADDER_PARAMS, ws, stage, ratio)
            write_job(root / str(i), train_results(strategy, step_ms=20.0 + 5 * stage + ws, world_size=ws,
                                                   memory=memory))
            i += 1
    write_job(root / str(i), train_results("zero2", world_size=4, status="failed"))
    return root
