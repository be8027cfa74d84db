"""How long one NCCL collective takes on a named system: NCCL's own tuner model, every protocol.

One alpha-beta line cannot follow a real sweep: NVIDIA's 8 x H100 all-reduce goes from 14 us at 8 B
to 62.6 ms at 16 GiB through three regimes, and a line through all of it misses by up to 39%. NCCL
itself picks, for every call, the fastest of several (algorithm, protocol) pairs by a cost model
(src/graph/tuning.cc, `ncclTopoTuneModel` / `ncclTopoGetAlgoTime`); this module is that model:

    time = latency(algorithm, protocol) + bytes / algbw(algorithm, protocol)

- protocols: LL (8-byte flag words: half the bus bandwidth, capped by `llMaxBws`, the lowest
  latency), LL128 (128-byte lines: 0.92 of the bandwidth, capped per channel), Simple (the whole
  bandwidth, the highest latency);
- algorithms: ring (bus bandwidth x n / (2(n-1)) for all-reduce), tree (all-reduce only: half the
  bus bandwidth, capped per channel, with the tuner's correction for medium sizes), and NVLS
  (NVLink SHARP: Hopper NVSwitch systems, one node, all-reduce, Simple only);
- latency: base + intra-node steps x NVLink hop + network steps x network hop (x 1.9 for a
  multi-node ring all-reduce with Simple: the tuner's "plateau"); tree: 2 (local ranks - 1 + log2 nodes)
  hops.

Every constant is NCCL's (tuning.cc's tables as of NCCL 2.2x, the same ones torch's port in
torch/_inductor/comm_analysis.py carries; topo.h's per-link NVLink speeds), except two terms of
ddp-lab's own for NVLS, where the tuner's formula (bus bandwidth x 2 x 0.85) predicts 338 GB/s of
algorithm bandwidth on 8 H100s and NVIDIA's sweep measures 274:

- traffic: an NVLS all-reduce pulls every shard's contributions through the switch (each GPU
  sends S and gets back S/n) and multicasts each reduced shard (sends S/n, receives S): S (1 + 1/n)
  per direction per link, so algbw = NVLink bandwidth x 0.85 (NCCL's nvlsEfficiency for Hopper)
  x (channels - 1) / channels / (1 + 1/n);
- pipeline fill: two stages, each one slice per channel before the switch streams (NCCL_BUFFSIZE
  4 MiB / NCCL_STEPS 8 = 512 KiB per channel, NCCL_NVLS_NCHANNELS 16): 16 MiB at algbw. This term
  was added after looking at the 8 x H100 table's middle sizes (docs/notebook/predict.md says so); its size
  is NCCL's default buffer arithmetic, not fitted.
"""

from __future__ import annotations

import math

# tuning.cc (ncclTunerConstantsDefaults): [algorithm][protocol], microseconds; protocols LL, LL128, Simple
PROTOCOLS = ("LL", "LL128", "Simple")
BASE_LAT = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "nvls": (0.0, 0.0, 0.0)}
HW_LAT = {  # [hardware][algorithm][protocol]
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0.0, 0.0, 25.0)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "nvls": (0.0, 0.0, 0.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "nvls": (0.0, 0.0, 18.0)},
}
GENERATIONS = ("volta", "ampere", "hopper", "blackwell")
# [generation][nodes: 1, 2, more], GB/s
LL_MAX_BW = {"volta": (39.0, 39.0, 20.4), "ampere": (87.7, 22.5, 19.0), "hopper": (141.0, 45.0, 35.0),
             "blackwell": (282.0, 90.0, 70.0)}
PER_CH_RING_LL128 = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3, "hopper": (36.7,) * 3, "blackwell": (40.0,) * 3}
PER_CH_TREE_LL128 = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3, "hopper": (36.7, 36.7, 29.0),
                     "blackwell": (55.6, 31.67, 20.0)}
PER_CH_TREE = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0),
               "blackwell": (70.0, 42.8, 24.0)}
TREE_CORRECTION = (  # [protocol][log2(bytes / 64)], 64 B to 512 MiB
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)
RING_PLATEAU = 1.9          # ncclTopoGetAlgoTime: multi-node ring all-reduce, Simple
NVLS_EFFICIENCY = {"hopper": 0.85, "blackwell": 0.74}   # src/tuning/nvls.cc
NVLS_CHANNELS = 16          # NCCL_NVLS_NCHANNELS' default
SLICE_BYTES = 4 * 2**20 / 8  # NCCL_BUFFSIZE (4 MiB) / NCCL_STEPS (8): one pipeline slice per channel


def _log2i(n: int) -> int:
    return max(int(n).bit_length() - 1, 0)


def steps(op: str, n: int) -> int:
    return 2 * (n - 1) if op == "all_reduce" else n - 1


def options(system, op: str, nbytes: float, n: int) -> list[tuple[float, str]]:
    """(seconds, "algorithm/protocol") of every pair NCCL's tuner would consider for this call."""
    if n <= 1:
        return [(0.0, "none")]
    nodes = max(1, math.ceil(n / system.gpus_per_node))
    scale = min(nodes - 1, 2)
    gen = system.generation
    intra_hw = "nvlink" if system.gpus_per_node > 1 else "net"
    bus = (system.intra_busbw_Bps if nodes == 1 else system.inter_busbw_Bps) / 1e9   # GB/s
    ch = system.channels
    nsteps = steps(op, n)
    inter_steps = 0 if nodes == 1 else (2 * (nodes - 1) if op == "all_reduce" else nodes - 1)
    out = []
    for p, proto in enumerate(PROTOCOLS):
        intra_lat = HW_LAT[intra_hw]["ring"][p]
        if nodes > 1:
            intra_lat = max(intra_lat, 3.0 if proto == "Simple" else 1.0)
        inter_lat = HW_LAT["net"]["ring"][p]
        # ring
        if proto == "LL":
            bw = min(bus * 0.5, LL_MAX_BW[gen if nodes == 1 else "volta"][scale])
        elif proto == "LL128":
            bw = min(bus * 0.92, ch * PER_CH_RING_LL128[gen][scale]) if nodes == 1 else 0.0
        else:
            bw = bus
        if bw > 0:
            lat = BASE_LAT["ring"][p] + (nsteps - inter_steps) * intra_lat + inter_steps * inter_lat
            if proto == "Simple" and nodes > 1 and op == "all_reduce" and nbytes >= n / 16 * 65536:
                lat *= RING_PLATEAU
            algbw = bw if op in ("broadcast", "reduce") else bw * n / nsteps
            out.append((lat * 1e-6 + nbytes / (algbw * 1e9), f"ring/{proto}"))
        if op != "all_reduce":
            continue
        # tree
        if proto == "LL":
            bw = min(bus / 3.8, LL_MAX_BW[gen if nodes == 1 else "volta"][scale])
        elif proto == "LL128":
            bw = min(bus * (7 / 9 if nodes == 1 else 120 / 128), ch * PER_CH_TREE_LL128[gen][scale]) \
                if nodes <= 2 else 0.0
        else:
            bw = min(bus * 0.92, ch * PER_CH_TREE[gen][scale])
        if bw > 0:
            t_intra = HW_LAT[intra_hw]["tree"][p]
            if nodes > 1:
                t_intra = max(t_intra, 3.0 if proto == "Simple" else 1.0)
            lat = BASE_LAT["tree"][p] + 2 * ((n // nodes - 1) * t_intra + _log2i(nodes) * HW_LAT["net"]["tree"][p])
            algbw = bw * 0.5
            log_size = _log2i(int(nbytes) >> 6) if nbytes >= 64 else 0
            if log_size < len(TREE_CORRECTION[p]):
                algbw *= TREE_CORRECTION[p][log_size]
            out.append((lat * 1e-6 + nbytes / (algbw * 1e9), f"tree/{proto}"))
    if op == "all_reduce" and nodes == 1 and system.nvls and gen in NVLS_EFFICIENCY:
        algbw = (system.intra_busbw_Bps / 1e9 * NVLS_EFFICIENCY[gen] * (NVLS_CHANNELS - 1) / NVLS_CHANNELS
                 / (1 + 1 / n))
        fill = 2 * NVLS_CHANNELS * SLICE_BYTES
        out.append((HW_LAT["nvlink"]["nvls"][2] * 1e-6 + (nbytes + fill) / (algbw * 1e9), "nvls/Simple"))
    return out


def collective_s(system, op: str, nbytes: float, n: int) -> tuple[float, str]:
    """(seconds, "algorithm/protocol") of one collective: the fastest pair, as NCCL's tuner picks."""
    return min(options(system, op, nbytes, n))
