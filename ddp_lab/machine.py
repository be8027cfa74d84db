"""What this machine has: free memory, CUDA GPUs, and so which backend `backend=auto` means.

Asked by the launcher before anything starts (memory checks, nccl's one GPU per rank) and by a rank
(which backend to join with, how much memory a fault injection asks for), so both read one answer. torch is
imported where a question needs it: free memory and whether a GPU can be here at all are answered without it
(the launcher's first, torch-free checks read them).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path


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


def no_gpu_here() -> bool:
    """True when this machine surely has no NVIDIA GPU (no driver loaded, no device file), asked without torch;
    False when one may be there (then torch is asked)."""
    return not Path("/proc/driver/nvidia").exists() and not Path("/dev/nvidia0").exists()


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(name: str, local_world_size: int) -> str:
    """`auto` means nccl when this node has a CUDA GPU per local rank, else gloo on CPU."""
    if name != "auto":
        return str(name)
    if no_gpu_here():
        return "gloo"  # answered without importing torch
    return "nccl" if cuda_devices() >= local_world_size else "gloo"


def precision_problem(precision: str, device_type: str) -> str | None:
    """Why `train.precision` cannot run on `device_type` ("cpu" or "cuda"), None when it can.

    CPU: probed with one tiny autocast matmul, as a rank would run it (older torch releases warn and
    fall back to fp32 for a dtype their CPU autocast lacks). CUDA: asked without touching a GPU (the
    launcher must not create a CUDA context): fp16 runs on every CUDA GPU, bf16 needs one that
    supports it (Ampere or newer).
    """
    import torch

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    if str(precision) not in dtypes:
        return None if str(precision) == "fp32" else f"unknown precision {precision!r}: fp32, bf16 or fp16"
    dtype = dtypes[str(precision)]
    if device_type == "cuda":
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            return "this GPU does not support bf16 (Ampere or newer does): use fp16"
        return None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast(device_type, dtype=dtype):
                out = torch.ones(2, 2) @ torch.ones(2, 2)
    except (RuntimeError, ValueError, TypeError) as exc:
        return f"torch {torch.__version__} cannot autocast to {precision} on {device_type}: {exc}"
    if out.dtype != dtype:
        why = f" ({caught[0].message})" if caught else ""
        return f"torch {torch.__version__} does not autocast to {precision} on {device_type}{why}"
    return None
