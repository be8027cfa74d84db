"""The units every figure in ddp-lab is given in, defined once.

Sizes users type (`strategy.bucket_mb`, `task.size_mb`) and tables print are MiB, 2^20 bytes, like
torch DDP's `bucket_cap_mb`. Bandwidths are GB/s with GB = 10^9 bytes, as nccl-tests reports them.
"""

MiB = 2**20
GB = 1e9


def tensor_bytes(tensor) -> int:
    """Bytes a tensor's elements take (numel x element size), whatever its device or layout."""
    return tensor.numel() * tensor.element_size()
