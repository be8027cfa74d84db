"""Named GPU systems for `scale`: public figures only, each with where it comes from.

A system is GPUs per node, each GPU's dense bf16 peak and memory bandwidth, the bandwidth one GPU
has to the others inside a node and across nodes, and NCCL's latency constants. Collectives use
NCCL's own tuner model (src/graph/tuning.cc, `ncclTopoTuneModel` / `ncclTopoGetAlgoTime`):

    time = latency + bytes / algbw,   algbw = busbw * n / (2 (n - 1))   (ring all-reduce)
    ring latency = base + (nsteps - nInterSteps) * intraLat + nInterSteps * interLat
                   (x 1.9 for a multi-node ring all-reduce: the tuner's "plateau effect")
    tree all-reduce: algbw = 0.5 * min(0.9 * busbw, maxTreeBw),
                     latency = base + 2 * ((n / nodes - 1) * intraLat + log2(nodes) * interLat)

and, like NCCL, take the faster of ring and tree for each all-reduce.

Bus bandwidth: inside a node, a ring moves 2(n-1)/n of the message over each GPU's link, so the
ring's busbw is the per-direction link bandwidth. Across nodes, NCCL runs one ring per NIC (rail):
every crossing edge of every ring has its own NIC, and the busbw is NICs per node x NIC bandwidth,
capped by the NVLink bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddp_lab.analysis.predict.costs import PredictError
from ddp_lab.spec.bandwidth import bus_factor

# NCCL src/graph/tuning.cc (NVIDIA/nccl; the constants of ncclTopoTuneModel), microseconds.
NCCL_RING_BASE_US = 8.4        # baseLat[Ring][Simple]
NCCL_TREE_BASE_US = 0.0        # baseLat[Tree][Simple]
NCCL_RING_NVLINK_US = 3.4      # hwLat[NVLINK][Ring][Simple], per ring step
NCCL_RING_NET_US = 9.6         # hwLat[NET][Ring][Simple]
NCCL_TREE_NVLINK_US = 28.0     # hwLat[NVLINK][Tree][Simple]
NCCL_TREE_NET_US = 50.0        # hwLat[NET][Tree][Simple]
NCCL_RING_PLATEAU = 1.9        # ncclTopoGetAlgoTime: multi-node ring all-reduce latency factor
NCCL_MAX_TREE_BW = {True: 80.0, False: 110.0}  # GB/s, nNodes > 2 or not (Simple protocol)


@dataclass(frozen=True)
class System:
    name: str
    gpus_per_node: int
    peak_flops: float           # dense bf16 FLOP/s per GPU
    hbm_Bps: float              # memory bandwidth per GPU (the optimizer is memory-bound)
    intra_busbw_Bps: float      # ring bus bandwidth inside a node
    inter_busbw_Bps: float      # ring bus bandwidth across nodes (NICs per node x NIC bandwidth)
    link_Bps: float             # per-direction bandwidth of one GPU to the others (Scaling Book's W)
    mfu: float                  # fraction of peak a training step's matmuls reach (an assumption)
    sources: tuple[str, ...]


H100_SOURCES = (
    "989.4 TFLOP/s dense BF16, 3.35 TB/s HBM3, NVLink 900 GB/s bidirectional (450 GB/s each way): "
    "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM5)",
    "8 x ConnectX-7 400 Gb/s (50 GB/s) InfiniBand NDR per node: NVIDIA DGX H100 datasheet",
    "NCCL latency and tree constants: NVIDIA/nccl src/graph/tuning.cc (baseLat, hwLat, maxTreeBw)",
    "MFU 0.5: an assumption, near what Megatron-LM reports for GPT training (Narayanan et al., SC'21: 52% of "
    "A100 peak at 1T parameters)",
)

SYSTEMS = {
    "h100-nvlink": System(
        name="h100-nvlink", gpus_per_node=8, peak_flops=989.4e12, hbm_Bps=3.35e12,
        intra_busbw_Bps=450e9, inter_busbw_Bps=min(8 * 50e9, 450e9), link_Bps=450e9, mfu=0.5,
        sources=H100_SOURCES),
    "h100-ib": System(
        name="h100-ib", gpus_per_node=1, peak_flops=989.4e12, hbm_Bps=3.35e12,
        intra_busbw_Bps=50e9, inter_busbw_Bps=50e9, link_Bps=50e9, mfu=0.5,
        sources=H100_SOURCES[:1] + ("one 400 Gb/s (50 GB/s) InfiniBand NDR NIC per GPU and no NVLink between "
                                    "GPUs: every GPU a node of its own (ConnectX-7 datasheet)",) + H100_SOURCES[2:]),
    "a100-nvlink": System(
        name="a100-nvlink", gpus_per_node=8, peak_flops=312e12, hbm_Bps=2.039e12,
        intra_busbw_Bps=235e9, inter_busbw_Bps=min(8 * 25e9, 235e9), link_Bps=300e9, mfu=0.5,
        sources=("312 TFLOP/s dense BF16, 2,039 GB/s HBM2e, NVLink 600 GB/s bidirectional (300 GB/s each way): "
                 "NVIDIA A100 Tensor Core GPU datasheet (A100 SXM4 80GB)",
                 "ring bus bandwidth capped at 235 GB/s on sm80: NVIDIA/nccl src/graph/tuning.cc "
                 "(`if (compCap80) busBw = std::min(busBw, 235.0f)`)",
                 "8 x ConnectX-6 200 Gb/s (25 GB/s) InfiniBand HDR per node: NVIDIA DGX A100 datasheet",
                 *H100_SOURCES[2:])),
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


def ring_s(system: System, op: str, nbytes: float, n: int) -> float:
    if n <= 1:
        return 0.0
    nodes = _nodes(system, n)
    steps = 2 * (n - 1) if op == "all_reduce" else (n - 1)
    inter = (2 * (nodes - 1) if op == "all_reduce" else nodes - 1) if nodes > 1 else 0
    intra_lat = NCCL_RING_NVLINK_US if system.gpus_per_node > 1 else NCCL_RING_NET_US
    lat = NCCL_RING_BASE_US + (steps - inter) * intra_lat + inter * NCCL_RING_NET_US
    if nodes > 1 and op == "all_reduce":
        lat *= NCCL_RING_PLATEAU
    return lat * 1e-6 + nbytes * bus_factor(op, n) / busbw(system, n)


def tree_s(system: System, nbytes: float, n: int) -> float:
    """NCCL's tree all-reduce (the tuner's bandwidth cap and latency)."""
    if n <= 1:
        return 0.0
    nodes = _nodes(system, n)
    bw = 0.5 * min(0.9 * busbw(system, n), NCCL_MAX_TREE_BW[nodes > 2] * 1e9)
    per_node = min(n, system.gpus_per_node)
    intra_lat = NCCL_TREE_NVLINK_US if system.gpus_per_node > 1 else NCCL_TREE_NET_US
    lat = NCCL_TREE_BASE_US + 2 * ((per_node - 1) * intra_lat + math.log2(nodes) * NCCL_TREE_NET_US)
    return lat * 1e-6 + nbytes / bw


def collective_s(system: System, op: str, nbytes: float, n: int) -> tuple[float, str]:
    """(seconds, algorithm) of one collective: the faster of ring and tree for all-reduce."""
    ring = ring_s(system, op, nbytes, n)
    if op != "all_reduce":
        return ring, "ring"
    tree = tree_s(system, nbytes, n)
    return (tree, "tree") if tree < ring else (ring, "ring")
