"""Joining the process group torchrun prepared, which attempt this is, seeding, and waiting for the device.

Used inside a rank only: the worker joins, the tasks seed, timers and comm figures synchronize.
"""

from __future__ import annotations

import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


def init_from_env(backend: str, timeout_s: float) -> torch.device:
    """Join the process group torchrun prepared (RANK, WORLD_SIZE, MASTER_ADDR in the environment)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                            device_id=device if backend == "nccl" else None)
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def synchronize(device: torch.device) -> None:
    """Wait for the compute stream's queued work so a host clock reads the real end of it.

    Only the current stream, not the whole device: `torch.cuda.synchronize()` would also wait for
    NCCL's streams, so a clock read at the end of backward would swallow the collectives still in
    flight and exposed communication would read as zero. A collective's `wait()` makes the current
    stream wait for it, so a later synchronize still covers every collective waited for.
    """
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (`launcher.max_restarts`); 0 on the first
    attempt."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
