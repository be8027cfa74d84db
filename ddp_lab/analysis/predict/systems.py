"""Named GPU systems for `scale` and `published`: public figures only, each with where it comes from.

A system is GPUs per node, each GPU's dense bf16 peak and memory bandwidth, the bus bandwidth NCCL
sees inside a node (topo.h's per-link NVLink speed x links per GPU) and across nodes (NICs per node
x NIC bandwidth: one ring per rail), the GPU generation (which row of NCCL's tables applies), the
channels NCCL runs and whether the node's NVSwitch reduces (NVLS). Collectives: nccl.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddp_lab.analysis.predict.costs import PredictError


@dataclass(frozen=True)
class System:
    name: str
    gpu: str                    # what torch names the device by (measured.py matches measured rows on it)
    gpus_per_node: int
    peak_flops: float           # dense bf16 FLOP/s per GPU (fp16 tensor cores on Volta)
    hbm_Bps: float              # memory bandwidth per GPU (the optimizer is memory-bound)
    intra_busbw_Bps: float      # NCCL's bus bandwidth inside a node
    inter_busbw_Bps: float      # across nodes (NICs per node x NIC bandwidth, at most the NVLink figure)
    link_Bps: float             # per-direction bandwidth of one GPU to the others (Scaling Book's W)
    mfu: float                  # fraction of peak a step reaches where nothing is measured (an assumption)
    sources: tuple[str, ...]
    generation: str = "hopper"  # the row of NCCL's tuner tables (nccl.GENERATIONS)
    channels: int = 16          # NCCL channels (torch's comm_analysis heuristic per generation)
    nvls: bool = False          # NVSwitch with NVLink SHARP: NCCL's NVLS all-reduce inside a node
    memory_bytes: float = 80e9  # each GPU's memory (the planner's fit; the datasheets in `sources`)


NCCL_SOURCES = (
    "NCCL's latency, protocol and per-channel constants: NVIDIA/nccl src/graph/tuning.cc "
    "(ncclTunerConstantsDefaults; baseLat, hwLat, llMaxBws, perChMax*, treeCorrectionFactor) and "
    "src/tuning/nvls.cc (nvlsEfficiency); channels per generation: torch/_inductor/comm_analysis.py",
)
H100_SOURCES = (
    "989.4 TFLOP/s dense BF16, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s bidirectional (450 GB/s each way): "
    "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM5); NCCL's bus bandwidth 18 links x 20.6 GB/s = "
    "370.8 GB/s (NVIDIA/nccl src/graph/topo.h SM90_NVLINK_BW)",
    "8 x ConnectX-7 400 Gb/s (50 GB/s) InfiniBand NDR per node: NVIDIA DGX H100 datasheet",
    *NCCL_SOURCES,
    "MFU 0.5: an assumption, near what Megatron-LM reports for GPT training (Narayanan et al., SC'21: 52% of "
    "A100 peak at 1T parameters)",
)

H200_SOURCES = (
    "989.4 TFLOP/s dense BF16 (the datasheet's 1,979 is with sparsity; the same GH100 compute as the H100), "
    "141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s bidirectional (450 GB/s each way): NVIDIA H200 Tensor Core GPU "
    "datasheet (H200 SXM); NCCL's bus bandwidth 18 links x 20.6 GB/s = 370.8 GB/s (NVIDIA/nccl src/graph/topo.h "
    "SM90_NVLINK_BW)",
    "8 x ConnectX-7 400 Gb/s (50 GB/s) InfiniBand NDR per node: NVIDIA DGX H200 datasheet",
    *NCCL_SOURCES,
    "MFU 0.5 where the measured table (measured.py) has no row: the assumption of the other systems",
)

SYSTEMS = {
    "h100-nvlink": System(
        name="h100-nvlink", gpu="H100", gpus_per_node=8, peak_flops=989.4e12, hbm_Bps=3.35e12,
        intra_busbw_Bps=370.8e9, inter_busbw_Bps=min(8 * 50e9, 370.8e9), link_Bps=450e9, mfu=0.5,
        sources=H100_SOURCES, generation="hopper", channels=16, nvls=True),
    "h100-ib": System(
        name="h100-ib", gpu="H100", gpus_per_node=1, peak_flops=989.4e12, hbm_Bps=3.35e12,
        intra_busbw_Bps=50e9, inter_busbw_Bps=50e9, link_Bps=50e9, mfu=0.5,
        sources=H100_SOURCES[:1] + ("one 400 Gb/s (50 GB/s) InfiniBand NDR NIC per GPU and no NVLink between "
                                    "GPUs: every GPU a node of its own (ConnectX-7 datasheet)",) + H100_SOURCES[2:],
        generation="hopper", channels=16),
    "h200": System(
        name="h200", gpu="H200", gpus_per_node=8, peak_flops=989.4e12, hbm_Bps=4.8e12,
        intra_busbw_Bps=370.8e9, inter_busbw_Bps=min(8 * 50e9, 370.8e9), link_Bps=450e9, mfu=0.5,
        sources=H200_SOURCES, generation="hopper", channels=16, nvls=True, memory_bytes=141e9),
    "a100-nvlink": System(
        name="a100-nvlink", gpu="A100", gpus_per_node=8, peak_flops=312e12, hbm_Bps=2.039e12,
        intra_busbw_Bps=235e9, inter_busbw_Bps=min(8 * 25e9, 235e9), link_Bps=300e9, mfu=0.5,
        sources=("312 TFLOP/s dense BF16, 2,039 GB/s HBM2e, NVLink 600 GB/s bidirectional (300 GB/s each way): "
                 "NVIDIA A100 Tensor Core GPU datasheet (A100 SXM4 80GB)",
                 "ring bus bandwidth capped at 235 GB/s on sm80: NVIDIA/nccl src/graph/tuning.cc "
                 "(`if (compCap80) busBw = std::min(busBw, 235.0f)`)",
                 "8 x ConnectX-6 200 Gb/s (25 GB/s) InfiniBand HDR per node: NVIDIA DGX A100 datasheet",
                 *H100_SOURCES[2:]),
        generation="ampere", channels=8),
    "v100-dgx1": System(
        name="v100-dgx1", gpu="V100", gpus_per_node=8, peak_flops=125e12, hbm_Bps=0.9e12,
        intra_busbw_Bps=120e9, inter_busbw_Bps=4 * 12.5e9, link_Bps=150e9, mfu=0.5,
        sources=("125 TFLOP/s fp16 tensor, 900 GB/s HBM2 (32 GB: the DGX-1's later V100s; the first had 16), "
                 "6 NVLinks of 25 GB/s each way: NVIDIA Tesla V100 "
                 "datasheet (SXM2); NCCL's bus bandwidth 6 x 20 GB/s (NVIDIA/nccl src/graph/topo.h "
                 "SM70_NVLINK_BW)",
                 "4 x 100 Gb/s InfiniBand per machine: pytorch/pytorch benchmarks/distributed/ddp/README.md "
                 "(the DGX-1 machines it ran on)",
                 *NCCL_SOURCES),
        generation="volta", channels=2, memory_bytes=32e9),
}


def get_system(name: str) -> System:
    if name not in SYSTEMS:
        raise PredictError(f"unknown system {name!r}; options: {', '.join(SYSTEMS)}")
    return SYSTEMS[name]


def _nodes(system: System, n: int) -> int:
    return max(1, math.ceil(n / system.gpus_per_node))


def busbw(system: System, n: int) -> float:
    """Ring bus bandwidth of n GPUs: the node's links inside one node, the rails across nodes."""
    return system.intra_busbw_Bps if _nodes(system, n) == 1 else system.inter_busbw_Bps
