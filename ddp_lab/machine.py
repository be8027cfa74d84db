"""What this machine has: free memory, CUDA GPUs, and so which backend `backend=auto` means.

Asked by the launcher before anything starts (memory checks, nccl's one GPU per rank) and by a rank
(which backend to join with, how much memory a fault injection asks for), so both read one answer.
"""

from __future__ import annotations

import os

import torch


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); elsewhere, total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(name: str, local_world_size: int) -> str:
    """`auto` means nccl when this node has a CUDA GPU per local rank, else gloo on CPU."""
    if name != "auto":
        return str(name)
    return "nccl" if cuda_devices() >= local_world_size else "gloo"
