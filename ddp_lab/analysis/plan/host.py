"""`--system this-machine`: this CPU host and gloo as the planner sees it, from its calibration (this_machine.json).

The lab's emulated cluster: `nodes` network namespaces on this machine joined by a shaped link (docs/network.md),
the ranks split evenly over them, every rank sharing the host's cores. Seven things differ from a GPU system, each
priced here, and each from `python benchmarks/plan_check.py calibrate`'s measurements:

- compute: one core's fp32 FLOP/s on the lab's model (the floor, `strategy=none`, one rank per core), and apart
  from it attention's scores and weighted sum, which on a CPU run slower a FLOP than the matmuls (both fitted to the
  floor at four contexts: docs/measured/plan_floor_curve.md). Ranks share the cores: with more ranks than cores a
  step's compute takes all the ranks' work over the cores (`shared_cores`), and a pipeline's schedule runs with its
  runnable ranks sharing them evenly, as Linux's scheduler shares them (cores.py); the optimizer, every rank's at
  once, ranks / cores as long;
- gloo's collectives: a ring of alpha-beta steps, all-reduce 2(n-1) steps moving 2(n-1)/n of the buffer,
  all-gather and reduce-scatter n-1 moving (n-1)/n, at loopback's measured bus bandwidth inside a node (gloo's
  all-reduce's; the lab's own rings' where the sharded strategies run them; shared by the ranks beyond the cores)
  or, when the group crosses nodes, at the link's measured bandwidth shared by the groups crossing it at once; each
  step's latency, measured with a core per rank, ranks / cores as long beyond the cores (a step waits for its peer
  to be scheduled: the predictor's held-out check found collectives slow so, docs/notebook/predict_measured.md);
- a ring step's wait: with more ranks than cores, each step of the context-parallel ring (a rendezvous of its
  ranks' sends and receives) waits until the peer is scheduled and has reached it, about a scheduler's time slice
  whatever the ranks a core (measured on a context-parallel job that is no layout the planner ranks:
  docs/measured/plan_context_wait.md). A floor under each step, not an addition: a long exchange covers it, and a
  peer with little compute between its steps reaches the next sooner (docs/measured/plan_unseen_long.md). But however
  little the ranks compute, each of the ring's collectives (its cp - 1 steps) still costs a scheduler's rendezvous
  and its chunks' own operations, longer the more ranks a core (`ring_collective_s`: the same ring job in 8
  micro-batches of one sequence; docs/measured/plan_context_collective.md);
- a micro-batch's fixed cost: each micro-batch a rank runs beyond its first (the accumulation's, the pipeline's:
  Python, autograd and the kernels' launch, whatever its FLOPs), measured as the floor's step at 8 micro-batches
  over its step at one, and stretched as compute is where the ranks share the cores;
- selective checkpointing's cost: a fixed cost a block and micro-batch (torch asks the lab's Python policy about
  every operation) and its recompute's memory-bound operations at their own rate, both from the floor with and
  without it in one micro-batch and in 8 (`selective_costs`), stretched as compute is;
- fp32 everywhere: 4 bytes per activation and gradient element on the wire;
- memory: each rank's share of the host's memory.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from ddp_lab.analysis.predict.costs import PredictError
from ddp_lab.analysis.predict.systems import System

CALIBRATION = Path(__file__).with_name("this_machine.json")
NODES = 2


@dataclass(frozen=True)
class HostSystem(System):
    """A System whose "GPUs" are ranks sharing this host's `cores` (module docstring)."""

    cores: int = 2
    nodes: int = NODES
    gbps: float = 1.0            # the emulated link's rate (network.gbps)
    latency_s: float = 1e-4      # one gloo ring step's fixed cost
    element_bytes: int = 4       # fp32 on the wire
    microbatch_s: float = 0.0    # a micro-batch's fixed cost beyond its FLOPs, at a core per rank
    attention_flops: float = 0.0  # one core's FLOP/s on attention's scores and weighted sum; 0: `peak_flops`
    ring_wait_s: float = 0.0     # the least a context-parallel ring step takes, ranks outnumbering cores
    ring_collective_s: float = 0.0  # the least a context-parallel ring collective costs, a rank a core (beyond cores)
    selective_block_s: float = 0.0  # selective checkpointing's fixed cost a block and micro-batch, at a core a rank
    selective_Bps: float = 0.0   # the rate selective's recomputed memory-bound operations move bytes; 0: `hbm_Bps`
    ring_busbw_Bps: tuple = ()   # (op, bus B/s) of the lab's rings on loopback; none: gloo's all-reduce's
    calibrated_on: str = ""      # the machine the calibration measured (`this_host()` there)

    def compute_share(self, ranks: int) -> float:
        """How many times longer a rank's work takes with `ranks` ranks busy at once on the host's cores."""
        return max(1.0, ranks / self.cores)

    def shared_cores(self, busy: float, work_fraction: float, ranks: int) -> float:
        """How many times its time at a core of its own the busiest rank's compute `busy` takes: the cores are never
        idle while any rank has work, so the step's compute takes at least every rank's work over the cores
        (`work_fraction`: the mean rank's work over the busiest's). Data parallel: `ranks / cores`; a pipeline's
        idle stages lend their cores to the others, and what its schedule outlasts that by is its bubble (cores.py
        runs the schedule with the ranks sharing the cores)."""
        all_work = busy * work_fraction * ranks / self.cores
        return max(busy, all_work) / busy if busy else 1.0

    def attention_weight(self) -> float:
        """How many of the matmuls' FLOPs one FLOP of attention's scores and weighted sum costs here."""
        return self.peak_flops / self.attention_flops if self.attention_flops else 1.0

    def ring_wait_ms(self, ranks: int) -> float:
        """The least a context-parallel ring step takes with `ranks` ranks on the host's cores: no floor while each
        rank has a core of its own."""
        return self.ring_wait_s * 1e3 if ranks > self.cores else 0.0

    def ring_collective_ms(self, ranks: int) -> float:
        """The least each collective of a context-parallel ring costs with `ranks` ranks on the host's cores, however
        little its ranks compute between its steps: the calibrated cost for each rank a core."""
        return self.ring_collective_s * 1e3 * self.compute_share(ranks) if ranks > self.cores else 0.0


def this_host() -> str:
    """This machine as a calibration names the one it measured: its cores, its CPU, torch's version, gloo."""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), platform.processor())
    except OSError:  # no /proc (macOS)
        cpu = platform.processor()
    return f"{os.cpu_count()}-core {cpu}, torch {version('torch')}, gloo"


def calibrated_elsewhere(system: HostSystem) -> str | None:
    """A line saying the calibration was measured on another machine than this one, or None: its figures are that
    machine's, whatever this one does."""
    here = this_host()
    if system.calibrated_on == here:
        return None
    return (f"calibrated on {system.calibrated_on or 'an unnamed machine'}, not this host ({here}): the figures are "
            "that machine's until `python benchmarks/plan_check.py calibrate` runs here")


def load_calibration(path: Path | str = CALIBRATION) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise PredictError(f"--system this-machine: cannot read its calibration {path} ({exc}); "
                           "run: python benchmarks/plan_check.py calibrate") from None


def this_machine(gpus: int, calibration: dict | None = None) -> HostSystem:
    """This host as `gpus` ranks over the calibration's emulated nodes (a node each where gpus < nodes)."""
    cal = load_calibration() if calibration is None else calibration
    nodes = min(int(cal["nodes"]), gpus)
    if gpus % nodes:
        raise PredictError(f"--system this-machine: {gpus} ranks do not split evenly over its {nodes} emulated nodes")
    per_node = gpus // nodes
    return HostSystem(
        name="this-machine", gpu="cpu", gpus_per_node=per_node, peak_flops=cal["core_flops"],
        hbm_Bps=cal["optimizer_Bps"], intra_busbw_Bps=cal["loopback_busbw_Bps"],
        inter_busbw_Bps=cal["link_busbw_Bps"], link_Bps=cal["loopback_busbw_Bps"], mfu=1.0,
        sources=(f"calibrated on {cal['machine']}, {cal['date']}: {cal['command']}",),
        generation="gloo", channels=1, memory_bytes=cal["memory_bytes"] / gpus, cores=int(cal["cores"]),
        nodes=nodes, gbps=float(cal["gbps"]), latency_s=cal["latency_s"], microbatch_s=cal.get("microbatch_s", 0.0),
        attention_flops=cal.get("attention_flops", 0.0), ring_wait_s=cal.get("ring_wait_s", 0.0),
        ring_collective_s=cal.get("ring_collective_s", 0.0),
        selective_block_s=cal.get("selective_block_s", 0.0), selective_Bps=cal.get("selective_Bps", 0.0),
        ring_busbw_Bps=tuple(cal.get("ring_busbw_Bps", {}).items()),
        calibrated_on=cal.get("machine", ""))


def compute_rates(shape, sequences: int, fwd_bwd_ms: dict) -> tuple[float, float]:
    """(one core's FLOP/s on all but attention's scores and weighted sum, its FLOP/s on those) from one rank's
    forward and backward of `sequences` sequences at two or more contexts ({context: ms}): each context's time is the
    rest's FLOPs at the first rate plus attention's at the second. Two contexts: two equations in two unknowns; more:
    the rates whose times miss the measured ones by the least squared relative error, so that no one context's noise
    decides attention's rate (docs/measured/plan_floor_curve.md)."""
    if len(fwd_bwd_ms) < 2:
        raise PredictError("attention's rate needs the floor at two contexts or more")

    def flops(context):  # (rest, attention) FLOPs of the step, forward and backward
        tokens = sequences * context
        attention = 3 * tokens * shape.layers * shape.attention_flops(context)
        return 3 * tokens * (shape.layers * shape.block_flops(context) + shape.head_flops()) - attention, attention

    rows = [(*flops(c), t) for c, t in sorted(fwd_bwd_ms.items())]
    aa = sum((x / t) ** 2 for x, _, t in rows)  # the normal equations of sum((x p + y q) / t - 1)^2
    ab = sum(x * y / t ** 2 for x, y, t in rows)
    bb = sum((y / t) ** 2 for _, y, t in rows)
    a1, b1 = sum(x / t for x, _, t in rows), sum(y / t for _, y, t in rows)
    det = aa * bb - ab * ab
    per_rest, per_attention = (a1 * bb - ab * b1) / det, (aa * b1 - ab * a1) / det  # ms a FLOP
    if per_rest <= 0 or per_attention <= 0:
        times = ", ".join(f"{t:.0f}" for *_, t in rows)
        raise PredictError(f"the floor at contexts {', '.join(str(c) for c in sorted(fwd_bwd_ms))} ({times} ms) gives "
                           "no positive rate for attention and the rest")
    return 1e3 / per_rest, 1e3 / per_attention


def selective_costs(shape, sequences: int, attention_flops: float, micro: int, one_ms: float,
                    many_ms: float) -> tuple[float, float]:
    """(selective checkpointing's fixed cost a block and micro-batch, s; the rate its recomputed memory-bound
    operations move bytes, B/s) from what it adds to one rank's forward and backward of `sequences` sequences at the
    shape's context in one micro-batch (`one_ms`) and in `micro` (`many_ms`): the same tokens, so the same recompute,
    with the blocks run `micro` times as often. What grows with the micro-batches is a cost a block runs each time
    (torch's selective checkpoint asks the lab's Python policy about every operation, forward and recompute); the
    rest, less attention's recompute at its calibrated rate (`attention_flops`, FLOP/s), is the memory-bound
    operations' traffic (shapes.py's `recomputed_elements_per_token`, fp32)."""
    layers, tokens = shape.layers, sequences * shape.context
    block_ms = (many_ms - one_ms) / ((micro - 1) * layers)
    attention_ms = tokens * layers * shape.attention_flops(shape.context) / attention_flops * 1e3
    traffic_ms = one_ms - layers * block_ms - attention_ms
    if block_ms < 0 or traffic_ms <= 0:
        raise PredictError(f"selective checkpointing added {one_ms:.0f} ms in one micro-batch and {many_ms:.0f} in "
                           f"{micro}: no positive cost a block and rate for its recompute")
    return block_ms / 1e3, tokens * layers * shape.recomputed_elements_per_token * 4 / (traffic_ms / 1e3)


def ring_wait_s(exposed_ms: float, ring_steps: int) -> float:
    """The least a ring step takes with more ranks than cores: what the most-waiting cp rank waited on its ring a step
    over the ring steps it ran, on a job whose exchange is short beside it and whose ranks compute long between
    steps (so neither covers nor cuts the wait: price.py's `cp_block_ms`)."""
    return exposed_ms / ring_steps / 1e3


def ring_collective_s(many_ms: float, one_ms: float, one_exposed_ms: float, micro: int, microbatch_s: float,
                      collectives: int, share: float) -> float:
    """The least a ring collective costs, a rank a core: a context-parallel job's forward and backward in `micro`
    micro-batches of one sequence (`many_ms`, its ranks computing little between their ring steps, so that each
    collective costs the scheduler's rendezvous and its chunks' operations, not a peer's compute), less the same job's
    compute in one micro-batch (`one_ms` less what it waited on its ring) and the micro-batches' fixed cost, over
    the collectives it ran and the ranks a core."""
    ring_ms = many_ms - (one_ms - one_exposed_ms) - (micro - 1) * microbatch_s * 1e3 * share
    if ring_ms <= 0:
        raise PredictError(f"a ring job took {many_ms:.0f} ms in {micro} micro-batches and {one_ms:.0f} in one: "
                           "no positive cost a ring collective")
    return ring_ms / collectives / share / 1e3


RING = {"all_reduce": (2, 2), "all_gather": (1, 1), "reduce_scatter": (1, 1)}
"""Per op: (ring steps per n - 1, buffer fractions moved per (n - 1) / n)."""


def gloo_collective_ms(system: HostSystem, op: str, nbytes: float, n: int, stride: int = 1,
                       lab_ring: bool = False) -> float:
    """One gloo ring collective over `n` ranks `stride` apart, ms (module docstring). Every group of the same axis
    runs at once: inside a node they share the cores, across they share the link. `lab_ring`: a reduce-scatter or
    all-gather on the lab's own rings (strategies/rings.py: zero2's, FSDP2's, zero1_torch's broadcasts), at their
    calibrated bus bandwidth inside a node where calibrated (gloo's all-reduce's otherwise)."""
    steps, moved = RING[op]
    ranks = system.gpus_per_node * system.nodes
    per_node = max(1, min(n, system.gpus_per_node // max(1, stride)))
    share = system.compute_share(ranks)  # ranks beyond the cores: a step waits for its peer to get one
    busbw = dict(system.ring_busbw_Bps).get(op) if lab_ring else None
    bandwidth = (busbw or system.intra_busbw_Bps) / share
    if per_node < n:  # the ring crosses the link: the groups crossing it at once share it
        bandwidth = min(bandwidth, system.inter_busbw_Bps * per_node / system.gpus_per_node)
    latency = system.latency_s * share
    seconds = steps * (n - 1) * latency + moved * (n - 1) / n * nbytes / bandwidth
    return seconds * 1e3
