"""Process-group set-up shared by the worker, the tasks and the tests."""

from __future__ import annotations

import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


def resolve_backend(name: str, local_world_size: int) -> str:
    """`auto` means nccl when this node has a CUDA GPU per local rank, else gloo on CPU."""
    if name != "auto":
        return name
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


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


def all_reduce_mean_(tensor: torch.Tensor, group=None) -> dist.Work | None:
    """Sum then divide in place: gloo has no ReduceOp.AVG, and one code path serves both backends."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    tensor.div_(dist.get_world_size(group))


def broadcast_module_state(module: torch.nn.Module, src: int = 0) -> None:
    """Copy every parameter and buffer (frozen ones too) from `src`, so all ranks start identical.

    Tied parameters appear once in `parameters()`, so each storage is sent once.
    """
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=src)
