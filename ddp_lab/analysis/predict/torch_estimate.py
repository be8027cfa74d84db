"""torch's own NCCL estimate, run on the CPU, as the reference beside ddp-lab's (nccl.py).

torch 2.13 ships a port of NCCL's tuner for inductor's scheduler (torch/_inductor/comm_analysis.py:
`estimate_nccl_collective_runtime_impl`, every algorithm and protocol but NVLS) and a rule that sizes
FSDP buckets as the smallest message that reaches 90% of the link's bandwidth
(`compute_min_saturation_bytes`, from per-interconnect profiles torch calibrated on its own fleet).
Both read the GPU generation, GPUs per node and NVLink from the machine they run on; here they are
told the named system's instead (the module's own lookups patched for the call), and its
bandwidths are torch's per-generation defaults, not the system's: what torch would say on it.
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

_OPS = {"all_reduce": "ALL_REDUCE", "all_gather": "ALL_GATHER", "reduce_scatter": "REDUCE_SCATTER"}


def _module():
    import torch._inductor.comm_analysis as ca  # imports inductor (about 2 s): only when asked
    return ca


@contextmanager
def _as_system(system):
    ca = _module()
    gen = getattr(ca.NVIDIA_GPU_TYPE, system.generation.upper())
    with mock.patch.object(ca, "get_gpu_type", lambda: gen), \
            mock.patch.object(ca.torch.cuda, "is_available", lambda: True), \
            mock.patch.object(ca.torch.cuda, "device_count", lambda: system.gpus_per_node), \
            mock.patch.object(ca, "_has_nvlink", lambda: system.gpus_per_node > 1):
        yield ca


def collective_s(system, op: str, nbytes: float, n: int) -> float | None:
    """torch's estimate in seconds, or None for an op it does not model (broadcast, reduce)."""
    if op not in _OPS:
        return None
    with _as_system(system) as ca:
        return ca.estimate_nccl_collective_runtime_impl(int(nbytes), n, getattr(ca.NCCL_COLL, _OPS[op])) / 1e3


def min_saturation_bytes(system, op: str, n: int) -> int | None:
    """torch's FSDP bucket rule: the smallest message at 90% of the interconnect's bandwidth."""
    if op not in _OPS:
        return None
    with _as_system(system) as ca:
        return ca.compute_min_saturation_bytes(n, getattr(ca.NCCL_COLL, _OPS[op]))


def seconds(system, op: str, nbytes: float, n: int) -> float:
    """torch's estimate where it has one; broadcast and reduce (which it does not model) from ddp-lab's
    nccl.py, so that a whole step can be replayed on torch's collective model."""
    from ddp_lab.analysis.predict import nccl

    t = collective_s(system, op, nbytes, n)
    return nccl.collective_s(system, op, nbytes, n)[0] if t is None else t
