"""One layout's step, priced in closed form, every term apart: what `python -m ddp_lab.plan` ranks.

A layout is dp x tp x pp x cp GPUs (torchtitan's and Megatron's order: tp innermost, then cp, dp, pp outermost, so a
TP group is consecutive ranks, inside a node when tp is at most its GPUs), the data-parallel strategy, the pipeline's
schedule and micro-batch count, and activation checkpointing. The global batch is `sequences` of the shape's context;
each data-parallel replica takes sequences / dp of them in `microbatches` micro-batches (gradient accumulation where
there is no pipeline), each sequence split over cp GPUs by tokens, each layer's weights over tp, the blocks over pp.

The terms, each in ms of one step (docs/plan.md works one of each by hand; tests/unit/test_plan.py holds them):

- compute: the busiest stage's FLOPs (its blocks, and the head on the last; 3 x forward for forward and backward)
  at the system's peak x MFU, split by tp and cp; `recompute`: activation checkpointing's second forward (full: the
  blocks' whole forward; selective: attention's scores and weighted sum by their FLOPs, and the memory-bound rest,
  norms, rotary embedding, SiLU and adds, as the elements they read and write at the GPU's memory bandwidth:
  shapes.py's `recomputed_elements_per_token`; by FLOPs alone it was priced at 0.9 ms where 51.7 were measured; on
  this machine that traffic at its calibrated rate and a fixed cost each block runs a micro-batch: `selective_ms`),
  twice under the zero-bubble schedule, whose input and weight halves each recompute (`recomputes`), and there one
  forward's FLOPs more: the lab's W, one backward over the stage's weights, runs the input's path again
  (`reruns_input_path`);
- micro: on this machine, each micro-batch's fixed cost beyond the first (host.py; the accumulation's and the
  pipeline's alike, v chunks each under interleaving), stretched as compute; no term on a GPU system yet;
- bubble: the busiest stage's idle share, compute x slots / m, with slots the other stages' work in the busiest's
  (the first micro-batch fills through the stages before it, the last drains through those after: p - 1 on even
  stages, fewer where the head makes the last stage the busiest) for GPipe and 1F1B, that over v for interleaved
  1F1B with v virtual stages per rank (Narayanan et al., SC'21), over 3 for ZB-H1 (Qi et al., ICLR'24: its bubble
  is about a third of 1F1B's);
- p2p: each micro-batch's activation sent forward and its gradient back at every stage boundary (bf16), priced on
  the link between neighbouring stages (NVLink inside a node, a GPU's NIC across), not hidden (an upper bound);
- tp: 4 all-reduces per block and micro-batch (2 forward, 2 backward; sequence parallelism's reduce-scatter and
  all-gather move the same bytes), 5 under full or selective recomputation (torch's checkpoint stops recomputing
  once the tensors backward needs are back, so a block's last all-reduce is not run again; selective keeps matmuls'
  outputs, not the all-reduce's: both counted in the lab, tests/parity/test_activation_checkpointing_mesh.py), 8
  under zero bubble's two recomputes, whose W runs the input path's 2 again (and the head's input gradient's 1:
  `reruns_input_path`), of the micro-batch's
  activation (bf16) over the tp group, blocking: added whole; per micro-batch also the vocabulary's (the head's
  input gradient, the embedding's output on a pipeline's only stage, and the vocabulary-parallel loss's three of one
  fp32 value a token); on this machine with more ranks than cores each all-reduce waits for its peers to be
  scheduled, at least the calibrated ring wait once or the compute between two of them (`tp_ms`: the lab's record
  measured 4.5 to 29 ms an all-reduce where their bytes price 1 to 2, docs/measured/plan_tp_wait.md);
- cp: the ring's K/V exchange per block (forward and again backward, with fp32 dK/dV), as `predict scale --cp`
  prices it, and the forward's again in each recompute, full or selective (both recompute attention and its
  exchange: counted in the lab, tests/parity/test_activation_checkpointing_mesh.py), hidden under the block's
  attention: only what outlasts it is added; on this machine with more ranks than cores each of those collectives'
  cp - 1 ring steps takes at least the calibrated `ring_wait_s` (host.py) or the peer's compute between two of its
  steps, whichever is less, and each collective at least its calibrated `ring_collective_s` (`cp_block_ms`);
- dp: the strategy's collectives over the dp x cp ranks (strided by tp x cp: across nodes once dp x cp x tp passes a
  node). DDP and ZeRO-1: one all-reduce's bytes of this GPU's gradients (bf16) in buckets of 25 MiB (torch DDP's
  first of 1 MiB), each sent when backward has produced it and the one before is done: the head's gradients first,
  each block's as its share of the last micro-batch's backward ends, the embedding's last (a lookup: no FLOPs);
  what is exposed is what the last buckets leave after backward ends (`bucketed_exposed_ms`; on a small model whose
  bytes fill one bucket, all of it). The lab's ZeRO-2: each bucket reduce-scattered so, and after the step every
  bucket all-gathered, exposed (strategies/zero2.py). torch's ZeroRedundancyOptimizer (zero1_torch) then broadcasts
  every updated parameter from its owner, fp32, after the step (an all-gather's bytes, exposed: it measured 1.15x to
  1.34x zero2's step on every split without a pipeline, docs/measured/plan.md); FSDP (ZeRO-3): every parameter
  gathered for each micro-batch's forward, the blocks' again for its backward (the embedding's lookup needs no
  weight back; the head, FSDP2's last unit, stays gathered), and the gradients reduce-scattered once, in the last
  micro-batch's backward (the lab accumulates the others under `no_sync`, gradient sync off: counted in the lab's
  per-collective record, docs/measured/plan_fsdp_accumulation.md), each hidden under its own micro-batch's compute;
  under a pipeline, as torchtitan and the lab run it, gathered once a step and reduced once
  (the stage's weights and gradients held whole across the micro-batches, in memory too), plus FSDP2's copies
  around those two collectives, at the memory bandwidth (`fsdp_copies_ms`: the shard into the gather's flat input,
  the gathered buffer out into each parameter, every gradient into the reduce-scatter's flat input; the profiled
  part of its measured 1.13x to 1.15x zero2's step at pp 2 x dp 2 on this machine, docs/pipelines.md); FSDP2
  issues one collective a unit (each block, the head, the embedding: `unit_collectives_ms`). Only what is not
  hidden is added;
- optimizer: AdamW at 28 bytes per parameter it updates, at the GPU's memory bandwidth (ZeRO: 1/(dp x cp) of them).

On `this-machine` (host.py) the same terms, with gloo's ring for the collectives (the lab's own rings, at their
calibrated bandwidth, for zero2's, FSDP2's and zero1_torch's reduce-scatters, all-gathers and broadcasts; each of
FSDP2's units' rings at least its steps' calibrated wait where ranks outnumber cores), fp32 on the wire, attention's
scores and weighted sum at the rate calibrated for them, and, where the ranks outnumber the host's cores, compute
that takes all the ranks' work over the cores; a pipeline's bubble there is what its schedule, run with the
runnable ranks sharing the cores evenly as Linux's scheduler shares them (cores.py: a heavy last stage gets no more
of a core than the others), outlasts that compute by (`stage_costs` its actions' costs). Nothing hides there
while the ranks fill the cores: gloo copies and sums on the CPU, so a collective only runs on a core compute
yields (DDP's all-reduce measured 550 of 555 ms exposed at dp 4, docs/measured/plan.md): the dp and cp terms are
then every collective whole.

Memory per GPU (bytes): model state at ZeRO's 16 bytes per parameter (bf16 weights and gradients, fp32 master,
AdamW's two moments; on this machine fp32 weights that are their own master, fp32 gradients and the two moments, 4 +
4 + 8, as the lab's census counts them), sharded by the strategy's ZeRO stage over dp x cp (Rajbhandari et al.,
SC'20), torch's ZeRO-1 by whole tensors (the busiest rank's share of its partition, `busiest_share`); activations 34
x s x b x h / tp bytes per block and micro-batch (Korthikanti et al., MLSys'23, with attention's scores not kept: a
flash kernel; TP with sequence parallelism, as Megatron and torchtitan pair them; twice that in fp32 here; a conf
model's block what the lab's keeps, its norms whole under TP, which the lab runs without sequence parallelism:
shapes.py's `saved_bytes_per_token_on`), 2 x s x
b x h / tp under full recomputation plus one block's whole set while it recomputes (after the loss's backward has
freed its micro-batch's log-softmax: the larger of the two, not both), under selective what its policy
keeps (shapes.py's `selective_saved_bytes_per_token`) plus the rest of one block while it recomputes; 1F1B and ZB-H1
keep min(m, p) micro-batches in flight on the first stage, interleaved 1F1B that and (p - 1) / v more, GPipe all m;
the loss's fp32 log-softmax of each micro-batch the last stage holds (GPipe all m, the others one); zero2's freed
buckets it keeps for the next step (`zero2_pool_bytes`, in the state: the census counts them there). `held` is the
busier of the first and the last stage, each with its own blocks as the lab splits them (the first stages take the
remainder: 5 blocks over 2 stages are 3 and 2), what the lab's census counts (model state and what autograd saved: the
measured checks hold it to the census); `total` adds the log-softmax's gradient, alive while the head's backward
runs, and a layout fits when its total is within the device's memory less 10% (the allocator's fragments, NCCL's
buffers, the CUDA context).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from functools import lru_cache

from ddp_lab.analysis.plan.cores import shared_span
from ddp_lab.analysis.plan.described import DescribedSystem
from ddp_lab.analysis.plan.host import HostSystem, gloo_collective_ms
from ddp_lab.analysis.plan.shapes import Shape
from ddp_lab.analysis.predict.nccl import collective_s
from ddp_lab.analysis.predict.systems import System
from ddp_lab.arithmetic.buckets import DEFAULT_BUCKET_MB
from ddp_lab.spec.pipeline import split_blocks
from ddp_lab.units import MiB

BF16, FP32 = 2, 4
MOMENTS_BYTES = 8  # per parameter: AdamW's m and v in fp32 (ZeRO's 12 of optimizer state with a bf16 run's fp32 master)
OPTIMIZER_BYTES = 28  # per updated parameter (read master, m, v, gradient; write master, m, v, weight)
HEADROOM = 0.9  # of the device's memory a layout may use
P2P_LATENCY_S = 10e-6
BUCKET_BYTES = DEFAULT_BUCKET_MB * MiB  # torch DDP's bucket_cap_mb default, and the lab's zero2's bucket_mb
FIRST_BUCKET_BYTES = MiB  # torch DDP's first bucket (its first_bucket_bytes_cap), sent as soon as it fills

STRATEGIES = {"torch_ddp": 0, "zero1_torch": 1, "zero2": 2, "fsdp_torch": 3}
"""The data-parallel strategies the planner prices, as the lab names them, with their ZeRO stage."""
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
CHECKPOINTING = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    strategy: str = "torch_ddp"
    schedule: str = "1f1b"
    microbatches: int = 1
    checkpointing: str = "none"
    stages_per_rank: int = 1  # interleaved 1F1B's v

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def describe(self) -> str:
        pipe = f" {self.schedule}{f' v{self.stages_per_rank}' if self.stages_per_rank > 1 else ''}" if self.pp > 1 \
            else ""
        return (f"dp{self.dp} tp{self.tp} pp{self.pp} cp{self.cp} {self.strategy}{pipe} m{self.microbatches} "
                f"ac:{self.checkpointing}")


@dataclass(frozen=True)
class Priced:
    layout: Layout
    terms: dict          # ms per step: compute, recompute, micro, bubble, p2p, tp, cp, dp, optimizer
    step_ms: float
    tokens_per_s_per_gpu: float
    mfu: float
    memory: dict         # bytes: state, activations, logits, total; capacity
    fits: bool

    @property
    def binding(self) -> str:
        """What limits this layout most: memory where it is within 5% of fitting, else its largest term that is not
        the model's own compute."""
        if self.memory["total"] > 0.95 * self.memory["capacity"]:
            return "memory"
        overheads = {k: v for k, v in self.terms.items() if k not in ("compute",)}
        name, value = max(overheads.items(), key=lambda kv: kv[1])
        return BINDING_WORDS[name] if value > 0.05 * self.step_ms else "compute"


BINDING_WORDS = {"recompute": "recompute", "micro": "micro cost", "bubble": "bubble", "p2p": "pp sends",
                 "tp": "tp comm", "cp": "cp comm", "dp": "dp exposed", "optimizer": "optimizer"}


def group_system(system: System, n: int, stride: int) -> System:
    """The system as a group of `n` ranks `stride` apart sees it (nccl.py prices a group of consecutive ranks):
    as many of them share a node as fit in it at that stride, and across nodes each has its share of the NICs."""
    per_node = max(1, min(n, system.gpus_per_node // max(1, stride)))
    if per_node == system.gpus_per_node:
        return system
    return replace(system, gpus_per_node=per_node,
                   inter_busbw_Bps=system.inter_busbw_Bps * per_node / system.gpus_per_node)


@lru_cache(maxsize=1 << 16)
def collective_ms(system: System, op: str, nbytes: float, n: int, stride: int = 1, axis: str = "dp",
                  lab_ring: bool = False) -> float:
    """One collective over `n` ranks `stride` apart on the mesh's `axis`, ms: ddp-lab's NCCL model, gloo's ring on
    this machine (host.py; `lab_ring`: the lab's own rings, which the sharded strategies run on gloo), the
    calculator's ring on a described system (described.py)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if isinstance(system, HostSystem):
        return gloo_collective_ms(system, op, nbytes, n, stride, lab_ring)
    if isinstance(system, DescribedSystem):
        return system.ring_ms(op, nbytes, n, axis)
    return collective_s(group_system(system, n, stride), op, nbytes, n)[0] * 1e3


def p2p_ms(system: System, nbytes: float, apart: int) -> float:
    """One send between ranks `apart` ranks apart: NVLink inside a node, one GPU's share of the NICs across."""
    inside = apart < system.gpus_per_node and system.gpus_per_node > 1
    bandwidth = system.link_Bps if inside else system.inter_busbw_Bps / system.gpus_per_node
    latency = system.latency_s if isinstance(system, HostSystem) else P2P_LATENCY_S
    return (latency + nbytes / bandwidth) * 1e3


def bubble_slots(schedule: str, pp: int, stages_per_rank: int, others: float) -> float:
    """The busiest stage's idle time a step, in its own micro-batches: the fill and drain through the other stages,
    `others` of the busiest stage's work (pp - 1 where the stages are even), over v under interleaving and over 3
    under zero bubble (module docstring)."""
    if pp == 1:
        return 0.0
    if schedule == "interleaved_1f1b":
        return others / stages_per_rank
    if schedule == "zero_bubble":
        return others / 3
    return others


def in_flight(schedule: str, pp: int, m: int, stages_per_rank: int = 1, last: bool = False) -> float:
    """Micro-batches whose activations the first rank (`last`: the last rank) holds at once, in micro-batches of its
    blocks: GPipe all m on both; 1F1B and zero bubble min(m, p) on the first and one on the last (its backward
    follows each forward); interleaved 1F1B (p - 1) / v more on the first, and on the last what the schedule
    simulated on paper has it hold (spec/pipeline.py's `simulate`, which the lab's measured peaks equal:
    tests/parity/test_pipeline.py)."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if last:
        if schedule != "interleaved_1f1b":
            return 1.0
        return _simulated_peaks(schedule, pp, m, stages_per_rank)[-1] / stages_per_rank
    held = float(min(m, pp))
    return held + (pp - 1) / stages_per_rank if schedule == "interleaved_1f1b" else held


@lru_cache(maxsize=1024)
def _simulated_peaks(schedule: str, pp: int, m: int, chunks: int) -> tuple:
    from ddp_lab.spec.pipeline import simulate

    return tuple(simulate(schedule, pp, m, chunks).peak_in_flight)


def stage_blocks(shape: Shape, pp: int) -> int:
    """Blocks on the busiest stage: as even as they split."""
    return math.ceil(shape.layers / pp)


def price(shape: Shape, system: System, layout: Layout, sequences: int, mfu: float | None = None,
          capacity: float | None = None, attention_mfu: float | None = None, headroom: float = HEADROOM) -> Priced:
    """`layout`'s step for a global batch of `sequences` sequences of `shape.context` tokens (module docstring).
    `attention_mfu`: the fraction of peak attention's scores and weighted sum reach, where it is not the matmuls'
    `mfu` (a kernel of its own, which Float8 does not speed up); None: the same."""
    lay, d = layout, shape.d_model
    mfu = system.mfu if mfu is None else mfu
    capacity = system.memory_bytes if capacity is None else capacity
    host = isinstance(system, HostSystem)
    share = system.compute_share(lay.gpus) if host else 1.0  # ranks sharing the host's cores
    wire = system.element_bytes if host else BF16  # an activation's, a gradient's
    flops_per_ms = system.peak_flops * mfu / 1e3  # one GPU's, or one core's
    # attention's FLOPs weighed as matmul FLOPs at `mfu`: attention_flops x `attend` costs what they take
    attend = mfu / attention_mfu if attention_mfu is not None else system.attention_weight() if host else 1.0
    per_replica = sequences / lay.dp
    micro = per_replica / lay.microbatches               # sequences per micro-batch
    tokens = per_replica * shape.context / lay.cp        # tokens this GPU's stage processes per step
    micro_tokens = tokens / lay.microbatches
    blocks = stage_blocks(shape, lay.pp)
    block = shape.block_flops(shape.context) + (attend - 1) * shape.attention_flops(shape.context)
    last_stage = blocks * block + shape.head_flops()
    forward = tokens * last_stage / lay.tp / flops_per_ms
    compute = 3 * forward
    recompute = 0.0
    if lay.checkpointing == "full":
        recompute = tokens * blocks * block / lay.tp / flops_per_ms
    elif lay.checkpointing == "selective":
        recompute = selective_ms(shape, system, lay, tokens, blocks, attend / flops_per_ms)
    recompute *= recomputes(lay)
    recomputed_block = recompute / (tokens * blocks) if blocks else 0.0  # ms a token and block
    if reruns_input_path(lay):  # W's one backward runs the stage's input path again: a forward's FLOPs
        recompute += forward
    busy = compute + recompute
    all_stages = shape.layers * block + shape.head_flops()
    if host:  # the ranks share the cores: all their work over them, a pipeline's schedule as the scheduler shares them
        stretch = system.shared_cores(busy, all_stages / lay.pp / last_stage, lay.gpus)
        bubble = shared_bubble(shape, system, lay, block, micro_tokens / lay.tp / flops_per_ms,
                               recomputed_block * micro_tokens, busy * stretch)
        compute, recompute, busy = compute * stretch, recompute * stretch, busy * stretch
    else:
        stretch, others = 1.0, all_stages / last_stage - 1  # the other stages' work, in the busiest's
        bubble = busy * bubble_slots(lay.schedule, lay.pp, lay.stages_per_rank, others) / lay.microbatches
    micro_cost = system.microbatch_s * 1e3 * (lay.microbatches * lay.stages_per_rank - 1) * stretch if host else 0.0
    activation = micro_tokens * d * wire  # one micro-batch's activation between stages / in a TP all-reduce
    p2p = 0.0
    if lay.pp > 1:
        hops = 2 * lay.microbatches * lay.stages_per_rank
        p2p = hops * p2p_ms(system, activation, lay.gpus // lay.pp)
    tp = tp_ms(shape, system, lay, blocks, activation, micro_tokens, busy) if lay.tp > 1 else 0.0
    cp = 0.0
    if lay.cp > 1:
        # a block's compute a micro-batch, forward, backward and recompute: a ring's peer does it between its steps
        block_ms = busy * (blocks * block / last_stage) / (blocks * lay.microbatches)
        cp = blocks * lay.microbatches * cp_block_ms(shape, system, lay, micro_tokens, attend, flops_per_ms / stretch,
                                                     block_ms)
    # the embedding on the first stage, the head on the last (the busiest, priced): both on a pipeline's only stage
    vocab_params = shape.vocab * d * (2 if lay.pp == 1 else 1) / lay.tp
    stage_params = blocks * shape.block_params / lay.tp + vocab_params
    shards = lay.dp * lay.cp
    stage = STRATEGIES[lay.strategy]
    segments = gradient_segments(shape, lay, blocks, busy / lay.microbatches * 2 / 3, wire)
    regathered = [(shape.block_params * wire / lay.tp, 0.0)] * blocks  # the units FSDP2 gathers again for backward
    dp = dp_ms(system, lay, segments, busy / lay.microbatches, stage_params * FP32, regathered) if shards > 1 else 0.0
    if shards > 1 and stage >= 3 and lay.pp > 1:
        dp += fsdp_copies_ms(system, stage_params, shards, wire) * share
    updated = stage_params / (shards if stage >= 1 else 1)
    optimizer = OPTIMIZER_BYTES * updated / system.hbm_Bps * 1e3 * share
    terms = {"compute": compute, "recompute": recompute, "micro": micro_cost, "bubble": bubble, "p2p": p2p, "tp": tp,
             "cp": cp, "dp": dp, "optimizer": optimizer}
    step = sum(terms.values())
    memory = memory_bytes(shape, lay, micro, vocab_params, shards, wire)
    memory["capacity"] = capacity
    per_gpu = sequences * shape.context / (step / 1e3) / lay.gpus
    model_flops = 3 * (shape.layers * shape.block_flops(shape.context) + shape.head_flops())
    return Priced(lay, terms, step, per_gpu, per_gpu * model_flops / system.peak_flops, memory,
                  memory["total"] <= headroom * capacity)


def selective_ms(shape: Shape, system: System, lay: Layout, tokens: float, blocks: int, ms_per_flop: float) -> float:
    """Selective checkpointing's recompute, ms a step: attention's FLOPs (`ms_per_flop`: attention's) and the rest as
    memory traffic at the system's HBM bandwidth; on this machine the traffic at the calibrated rate those small
    operations reach, and a fixed cost each block runs a micro-batch (host.py's `selective_costs`)."""
    host = isinstance(system, HostSystem)
    wire = system.element_bytes if host else BF16
    traffic_Bps = (system.selective_Bps or system.hbm_Bps) if host else system.hbm_Bps
    fixed = system.selective_block_s * 1e3 * blocks * lay.microbatches if host else 0.0
    return (tokens * blocks * shape.attention_flops(shape.context) * ms_per_flop / lay.tp
            + tokens * blocks * shape.recomputed_elements_per_token * wire / lay.tp / traffic_Bps * 1e3 + fixed)


def shared_bubble(shape: Shape, system: HostSystem, lay: Layout, block: float, ms_per_flop: float,
                  recomputed_block: float, work_ms: float) -> float:
    """What a pipeline's schedule, run with its ranks sharing the host's cores (cores.py), outlasts `work_ms`, every
    rank's work over the cores, by: its bubble on this machine (none without a pipeline). The actions cost
    `stage_costs`."""
    if lay.pp == 1:
        return 0.0
    span = shared_span(lay.schedule, lay.pp, lay.microbatches, lay.stages_per_rank,
                       stage_costs(shape, lay, block, ms_per_flop, recomputed_block), lay.gpus // lay.pp, system.cores)
    return span - work_ms if span > work_ms * (1 + 1e-9) else 0.0  # not float noise


def stage_costs(shape: Shape, lay: Layout, block: float, ms_per_flop: float, recomputed_block: float) -> tuple:
    """(F, I, W) ms of one micro-batch at a core of its own, by pipeline stage (pp x v of them, the blocks split as
    the lab splits them, the head on the last): the forward, the input's gradient and the weights' (a forward's FLOPs
    each; a backward, B, is I and W), each block's recompute (`recomputed_block`, ms, every recompute of the
    micro-batch) shared between I and W, and under zero bubble with checkpointing W's rerun of the input path, a
    forward more (`reruns_input_path`)."""
    counts = [len(r) for r in split_blocks(shape.layers, lay.pp * lay.stages_per_rank)]
    costs = []
    for s, count in enumerate(counts):
        forward = (count * block + (shape.head_flops() if s == len(counts) - 1 else 0.0)) * ms_per_flop
        recompute = count * recomputed_block / 2
        costs.append((forward, forward + recompute, forward + recompute + (forward if reruns_input_path(lay) else 0.0)))
    return tuple(costs)


def cp_block_ms(shape: Shape, system: System, lay: Layout, micro_tokens: float, attend: float, flops_per_ms: float,
                block_ms: float) -> float:
    """The cp term of one block and micro-batch (module docstring): the ring's K/V exchange, less what the block's
    attention hides of it. On this machine with more ranks than cores each ring step takes at least the calibrated
    `ring_wait_s` (host.py): a rank's step waits until its peer is scheduled and reaches it, which a long exchange
    covers, and which never outlasts the peer's compute since its last ring step (`block_ms` over the steps); but each
    collective, however little the peer computes, at least its calibrated least cost (`ring_collective_ms`).
    `flops_per_ms`: the rate attention's FLOPs run at, slowed where ranks share the cores."""
    wire = system.element_bytes if isinstance(system, HostSystem) else BF16
    kv = 2 * micro_tokens * lay.cp * shape.d_kv  # K and V of the whole sequence a ring moves, per micro-batch
    gather = collective_ms(system, "all_gather", kv * wire, lay.cp, lay.tp, "cp")
    # forward, backward and each recompute's forward gather K and V; backward reduce-scatters dK and dV
    exchange = (2 + recomputes(lay)) * gather + collective_ms(system, "reduce_scatter", kv * FP32, lay.cp, lay.tp, "cp")
    attention = ring_collectives(lay) * micro_tokens * attend * shape.attention_flops(shape.context) / lay.tp
    attention /= flops_per_ms
    exposed = max(0.0, exchange - attention * hides(system, lay))
    if not isinstance(system, HostSystem):
        return exposed
    steps = ring_steps(lay)
    least = ring_collectives(lay) * system.ring_collective_ms(lay.gpus)
    return max(exposed, least, steps * min(system.ring_wait_ms(lay.gpus), block_ms / steps))


def ring_collectives(lay: Layout) -> int:
    """A context-parallel ring's collectives a block and micro-batch: 3 (K and V forward and backward, dK and dV)
    and one more forward a recompute."""
    return 3 + recomputes(lay)


def ring_steps(lay: Layout) -> int:
    """A context-parallel ring's steps a block and micro-batch: each of its collectives' cp - 1."""
    return ring_collectives(lay) * (lay.cp - 1)


def tp_ms(shape: Shape, system: System, lay: Layout, blocks: int, activation: float, micro_tokens: float,
          busy: float) -> float:
    """TP's all-reduces of a step (module docstring): the blocks', and per micro-batch the vocabulary's (the head's
    input gradient, and the embedding's output without a pipeline: both split by rows of the vocabulary; the loss's
    max, sum of exponentials and target logit over the split rows). On this machine with more ranks than cores each
    all-reduce waits for its peers to be scheduled: it takes at least the calibrated ring wait once (its ring steps
    then follow one another with no compute between them) or the rank's compute between two of its all-reduces
    (`busy`, the step's, over them), whichever is less."""
    recomputed = (shape.tp_regions - 1) * recomputes(lay)  # all but the last, full or selective
    rerun = reruns_input_path(lay)  # W's backward all-reduces again: each region's input's, the head's input's
    per_block = 2 * shape.tp_regions + recomputed + (shape.tp_regions if rerun else 0)
    vocab = (2 if lay.pp == 1 else 1 + rerun) if shape.vocab else 0
    ones = per_block * blocks + vocab  # of the activation's bytes
    losses = 3 if shape.vocab else 0  # of one fp32 value a token
    one = collective_ms(system, "all_reduce", activation, lay.tp, axis="tp")
    loss = collective_ms(system, "all_reduce", micro_tokens * FP32, lay.tp, axis="tp")
    priced = lay.microbatches * (ones * one + losses * loss)
    floor = system.ring_wait_ms(lay.gpus) if isinstance(system, HostSystem) else 0.0
    if not floor:
        return priced
    count = lay.microbatches * (ones + losses)
    return max(priced, count * min(floor, busy / count))


def recomputes(lay: Layout) -> int:
    """How often each checkpointed block's forward runs again a micro-batch: once, in its backward; twice under the
    zero-bubble schedule, whose input half (I) and weight half (W) each run a backward through the block (the lab's
    W is one backward for all the stage's weights: tests/unit/test_zero_bubble_weights.py counts one recompute in
    it). Selective checkpointing under zero bubble is refused (torch allows one backward per region)."""
    if lay.checkpointing == "none":
        return 0
    return 2 if lay.pp > 1 and lay.schedule == "zero_bubble" else 1


def reruns_input_path(lay: Layout) -> bool:
    """Whether W runs the stage's input path again: under zero bubble with checkpointing the lab's W is one backward
    over every weight (`recomputes`), and autograd runs it through the input's path between the weights too, whose
    gradients I already sent (pipeline_parallel/lab.py's `backward_weights_at_once`). Counted on the lab's block: W
    runs 2.8 forwards' FLOPs where I runs 1.8 (the recompute, 0.8, in each), and under TP it issues the input path's
    all-reduces again, a block's 2 and the head's 1: at tp 2 x pp 2 (2 blocks a stage) the lab's record counts 21 a
    micro-batch, where 1F1B issues 14 and the planner counted 16 without them (tests/unit/test_zero_bubble_weights.py,
    test_plan.py's by-hand test, docs/measured/plan_zero_bubble_w.md)."""
    return lay.pp > 1 and lay.schedule == "zero_bubble" and lay.checkpointing != "none"


def hides(system: System, lay: Layout) -> float:
    """1 where a collective can run under compute, 0 on this machine while the ranks fill its cores (module
    docstring: gloo's copies and sums need a core)."""
    return 0.0 if isinstance(system, HostSystem) and lay.gpus >= system.cores else 1.0


def gradient_segments(shape: Shape, lay: Layout, blocks: int, backward_ms: float, wire: int) -> list[tuple]:
    """(bytes, ms) of the busiest (last) stage's gradients in the order the last micro-batch's backward produces
    them, each taking its share of `backward_ms` by its FLOPs: the head's, each block's, and without a pipeline the
    embedding's last (a lookup: no FLOPs of its own); a GPU's 1/tp of each."""
    d, block, head = shape.d_model, shape.block_flops(shape.context), shape.head_flops()
    per_flop = backward_ms / (blocks * block + head)
    segments = [(shape.vocab * d * wire / lay.tp, head * per_flop)] if shape.vocab else []
    segments += [(shape.block_params * wire / lay.tp, block * per_flop)] * blocks
    if shape.vocab and lay.pp == 1:
        segments.append((shape.vocab * d * wire / lay.tp, 0.0))
    return segments


def bucketed_exposed_ms(segments: list[tuple], collective, first: float = BUCKET_BYTES,
                        cap: float = BUCKET_BYTES, hide: float = 1.0) -> float:
    """What a bucketed all-reduce leaves after backward ends, ms. `segments`: (bytes, ms) as backward produces them,
    each segment's bytes arriving evenly over its ms (at its end where ms is 0); bucketed in order, `first` bytes,
    then `cap` each (bytes taken as divisible, as buckets of at most the cap are); each bucket's `collective(bytes)`
    runs once it is full and the one before is done (first in, first out). `hide` 0: nothing runs under backward
    (this machine's full cores): every bucket's collective after it. In closed form per segment: of n equal buckets
    closing evenly a gap apart, the last finishes at the latest of the queue's end plus n collectives, the first's
    close plus n, and the last's close plus one (a queue's finish is the latest of each arrival plus the service of
    those after it): for one even stream, the bucket-size model's `pipeline_exposed` (analysis/cost_model.py)."""
    now = free = pending = 0.0
    limit = first
    for nbytes, ms in segments:
        rate = nbytes / ms if ms > 0 else math.inf
        start, left = now, nbytes
        if pending + left >= limit:  # the open bucket closes in this segment
            needed = limit - pending
            close = start + (needed / rate if ms > 0 else 0.0)
            free = max(free, close * hide) + collective(limit)
            left, pending, limit = left - needed, 0.0, cap
            n = int(left // cap)
            if n:
                gap = cap / rate if ms > 0 else 0.0
                one = collective(cap)
                free = max(free + n * one, (close + gap) * hide + n * one, (close + n * gap) * hide + one)
                left -= n * cap
        pending += left
        now = start + ms
    if pending > 0:
        free = max(free, now * hide) + collective(pending)
    return max(0.0, free - now * hide)


def dp_ms(system: System, lay: Layout, segments: list[tuple], micro_busy: float, params: float = 0.0,
          regathered: list[tuple] = ()) -> float:
    """The data-parallel strategy's exposed collectives over the dp x cp ranks, one rank of each TP group (module
    docstring): `segments` the stage's gradients as backward produces them (`gradient_segments`), `micro_busy` one
    micro-batch's compute to hide under, `params` bytes of the stage's fp32 parameters (what torch's
    ZeroRedundancyOptimizer broadcasts), `regathered` (bytes, ms) of the units FSDP2 gathers again for backward
    without a pipeline (the blocks': the embedding's lookup needs no weight back, the head, its last unit, is not
    resharded after forward)."""
    shards, stride, hide = lay.dp * lay.cp, lay.tp, hides(system, lay)
    grads = sum(nbytes for nbytes, _ in segments)
    if lay.strategy == "zero2":  # each bucket reduce-scattered as it fills; the step's all-gather after it, exposed
        reduce = bucketed_exposed_ms(segments, lambda n: collective_ms(system, "reduce_scatter", n, shards, stride,
                                                                       lab_ring=True), BUCKET_BYTES, hide=hide)
        return reduce + collective_ms(system, "all_gather", grads, shards, stride, lab_ring=True)
    if STRATEGIES[lay.strategy] < 3:
        reduce = bucketed_exposed_ms(segments, lambda n: collective_ms(system, "all_reduce", n, shards, stride),
                                     FIRST_BUCKET_BYTES, hide=hide)
        if lay.strategy != "zero1_torch":
            return reduce
        # torch's ZeroRedundancyOptimizer: DDP's all-reduce, then each owner broadcasts its updated parameters
        # after the step, nothing left to hide under (an all-gather's bytes, in the parameters' fp32)
        return reduce + collective_ms(system, "all_gather", params, shards, stride, lab_ring=True)
    gather = unit_collectives_ms(system, lay, "all_gather", segments)
    scatter = unit_collectives_ms(system, lay, "reduce_scatter", segments)
    under = micro_busy * hide
    if lay.pp > 1:  # FSDP under a pipeline (torchtitan's): gathered once a step, reduced once
        return max(0.0, gather - under / 3) + max(0.0, scatter - under * 2 / 3)
    # every micro-batch gathers the whole stage forward and the blocks again backward; the accumulating ones run
    # under no_sync (gradient sync off: no reduce-scatter), the last reduce-scatters all
    again = unit_collectives_ms(system, lay, "all_gather", regathered)
    forward = lay.microbatches * max(0.0, gather - under / 3)
    return (forward + (lay.microbatches - 1) * max(0.0, again - under * 2 / 3)
            + max(0.0, again + scatter - under * 2 / 3))


def unit_collectives_ms(system: System, lay: Layout, op: str, segments: list[tuple]) -> float:
    """FSDP2's `op` over the stage, one collective a unit (each block, the head, the embedding: `segments`' bytes),
    ms. On this machine with more ranks than cores each unit's ring takes at least its n - 1 steps of the calibrated
    ring wait (host.py): each step waits for its peer to be scheduled, as the context-parallel ring's do."""
    shards, stride = lay.dp * lay.cp, lay.tp
    floor = (shards - 1) * system.ring_wait_ms(lay.gpus) if isinstance(system, HostSystem) else 0.0
    return sum(max(collective_ms(system, op, nbytes, shards, stride, lab_ring=True), floor) for nbytes, _ in segments)


def fsdp_copies_ms(system: System, stage_params: float, shards: int, element: int) -> float:
    """FSDP2's copies around one gather and one reduce-scatter of a stage's `stage_params` parameters of `element`
    bytes, ms at the system's memory bandwidth, each read and written once: the rank's shard into the all-gather's
    flat input (`foreach_all_gather_copy_in`), the gathered buffer out into each parameter
    (`split_with_sizes_copy`), each gradient into the reduce-scatter's flat input (`chunk_cat`). torch's
    _fully_shard/_fsdp_collectives.py; zero2 gathers and reduces in place in its buckets and copies none of them.
    `price` adds it under a pipeline, where FSDP gathers once a step, stretched where ranks share the host's cores."""
    moved = 2 * element * stage_params * (1 / shards + 1 + 1)
    return moved / system.hbm_Bps * 1e3


def memory_bytes(shape: Shape, lay: Layout, micro: float, vocab_params: float, shards: int,
                 element: int = BF16) -> dict:
    """The busier of the first and the last stage's memory (module docstring), each its own blocks as the lab splits
    them (`end_blocks`): model state, activations in flight, and on the last its loss's log-softmax. `element`: the
    bytes of a weight, a gradient and an activation: bf16 on a GPU (with an fp32 master copy in the optimizer's
    state), fp32 on this machine (the weights are the master: the optimizer keeps AdamW's two moments only, as the
    lab's census counts them). `vocab_params`: the embedding's on the first stage, the head's on the last (as many),
    both on a pipeline's only stage."""
    first_blocks, last_blocks = end_blocks(shape, lay)
    s, h = shape.context / lay.cp, shape.d_model
    whole_block = shape.saved_bytes_per_token_on(lay.tp) * s * micro * element / BF16
    if lay.checkpointing == "full":
        per_block = element * s * micro * h / lay.tp  # each block's input, on sequence shards under TP's SP
        extra = whole_block
    elif lay.checkpointing == "selective":  # what the policy keeps, and the rest of one block while it recomputes
        per_block = shape.selective_saved_bytes_per_token * s * micro / lay.tp * element / BF16
        extra = whole_block - per_block
    else:
        per_block, extra = whole_block, 0.0
    first_inputs = first_blocks * per_block * in_flight(lay.schedule, lay.pp, lay.microbatches, lay.stages_per_rank)
    activations = first_inputs + extra
    log_probs = FP32 * s * micro * shape.vocab / lay.tp  # the loss's log-softmax of one micro-batch, kept for backward

    def with_loss(kept: float) -> float:
        """The recompute's block beside `kept` log-softmaxes: under full checkpointing the last block is recomputed
        only once the loss's backward has freed its micro-batch's log-softmax, so the peak holds the larger of the
        two, as torch frees them (docs/measured/plan_full_peak.md)."""
        if lay.checkpointing == "full":
            return kept - log_probs + max(extra, log_probs)
        return kept + extra

    first_state = state_bytes(shape, lay, first_blocks, first_blocks * shape.block_params / lay.tp + vocab_params,
                              shards, element)
    if lay.pp == 1:
        state, saved = first_state, first_inputs + with_loss(log_probs)
    else:  # the last stage: its blocks' micro-batches in flight, and the log-softmax of those its loss has seen
        last = (last_blocks * per_block * in_flight(lay.schedule, lay.pp, lay.microbatches, lay.stages_per_rank,
                                                   last=True)
                + with_loss(log_probs * (lay.microbatches if lay.schedule == "gpipe" else 1)))
        last_state = first_state if last_blocks == first_blocks else state_bytes(  # as even as the first: the same
            shape, lay, last_blocks, last_blocks * shape.block_params / lay.tp + vocab_params, shards, element)
        state, saved = max((first_state, activations), (last_state, last), key=sum)
    held = state + saved
    return {"state": state, "activations": activations, "logits": 2 * log_probs, "held": held,
            "total": held + log_probs}


def end_blocks(shape: Shape, lay: Layout) -> tuple[int, int]:
    """The blocks the first and the last rank hold, split over pp x v stages as the lab splits them (the first
    stages take the remainder: 5 blocks over 2 stages are 3 and 2), rank r holding stages r, r + pp, ..."""
    if lay.pp == 1:
        return shape.layers, shape.layers
    counts = [len(r) for r in split_blocks(shape.layers, lay.pp * lay.stages_per_rank)]
    return sum(counts[0::lay.pp]), sum(counts[lay.pp - 1::lay.pp])


def state_bytes(shape: Shape, lay: Layout, blocks: int, params: float, shards: int, element: int) -> float:
    """A stage's model state on one GPU (module docstring): its `params` parameters' weights, gradients and optimizer
    state by the strategy's ZeRO stage over `shards`, torch's ZeRO-1 by whole tensors (of its `blocks` and the
    vocabulary's matrix), and zero2's pool of freed buckets."""
    stage = STRATEGIES[lay.strategy]
    optimizer_bytes = MOMENTS_BYTES + (FP32 if element < FP32 else 0)  # and an fp32 master below fp32
    whole_across_microbatches = stage >= 3 and lay.pp > 1  # FSDP under a pipeline: gathered once, reduced once
    weights = element * params / (shards if stage >= 3 and not whole_across_microbatches else 1)
    grads = element * params / (shards if stage >= 2 and not whole_across_microbatches else 1)
    if whole_across_microbatches:  # the sharded fp32 master of the weights stays too
        weights += FP32 * params / shards
    optimizer = optimizer_bytes * params / (shards if stage >= 1 else 1)
    if lay.strategy == "zero1_torch" and shards > 1:  # whole tensors to each rank: the busiest rank's share
        optimizer = optimizer_bytes * busiest_share(stage_tensors(shape, lay, blocks), shards)
    pool = zero2_pool_bytes(element * params) if lay.strategy == "zero2" and shards > 1 else 0.0
    return weights + grads + optimizer + pool


def stage_tensors(shape: Shape, lay: Layout, blocks: int | None = None) -> list[float]:
    """The elements of each parameter tensor of a stage on one GPU (`blocks` of them; None: the priced stage's, the
    most a stage holds): its blocks', the output head's (vocabulary-parallel under TP) and the final norm's; on a
    pipeline's only stage also the embedding's."""
    vocab = [shape.vocab * shape.d_model / lay.tp] * (2 if lay.pp == 1 else 1) if shape.vocab else []
    norm = [shape.d_model] if shape.vocab else []
    return (stage_blocks(shape, lay.pp) if blocks is None else blocks) * shape.block_tensors(lay.tp) + vocab + norm


def busiest_share(tensors: list[float], ranks: int) -> float:
    """The elements of the rank torch's ZeroRedundancyOptimizer gives the most optimizer state: each parameter
    whole, largest first, to the rank holding the fewest elements so far (`_partition_parameters`, over one
    parameter group; the lab's optimizer has one). A vocabulary's matrix can outweigh an even share by itself. The
    ranks in a heap of (held, rank): the least held, the lowest rank between equals, as torch's `min` finds it."""
    held = [(0.0, rank) for rank in range(ranks)]  # already a heap
    for size in sorted(tensors, reverse=True):
        least, rank = held[0]
        heapq.heapreplace(held, (least + size, rank))
    return max(least for least, _ in held)


def zero2_pool_bytes(grad_bytes: float, bucket: float = BUCKET_BYTES) -> float:
    """The lab's zero2 keeps freed gradient buckets from one step to the next for the next step's first ones
    (strategies/zero2.py's `_trim_pool`): the largest first, within 2 x bucket_mb, always fewer than the step has
    buckets. `grad_bytes` of gradients in buckets of `bucket` bytes (the last one the rest), bytes kept: the largest
    are whole buckets, so two of them where the step has three or more, one where it has two, none where one."""
    count = max(1, math.ceil(grad_bytes / bucket))
    return bucket * min(2, count - 1)
