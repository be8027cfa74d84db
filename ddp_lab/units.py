"""The units every figure in ddp-lab is given in, defined once.

Sizes users type (`strategy.bucket_mb`, `task.size_mb`) and tables print are MiB, 2^20 bytes, like
torch DDP's `bucket_cap_mb`. Bandwidths are GB/s with GB = 10^9 bytes, as nccl-tests reports them.
"""

KiB = 2**10
MiB = 2**20
GB = 1e9
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each floating-point format a knob names (train.precision, comm_dtype)."""


def tensor_bytes(tensor) -> int:
    """Bytes a tensor's elements take (numel x element size), whatever its device or layout."""
    return tensor.numel() * tensor.element_size()


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
