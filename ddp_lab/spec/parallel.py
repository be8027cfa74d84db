"""The mesh every rank sits on, said without torch: the `parallel` config node, where each rank lies on the
(dp, pp, cp, tp) grid (expert parallelism borrows ep of the dp x cp ranks), the tensor-parallel plan's vocabulary
and collective schedule, and what composes with the mesh (activation checkpointing, compile).

`world_size = dp x pp x cp x tp`: `parallel.tp` ranks split each layer (tensor parallelism), `parallel.pp` split
the blocks into stages, `parallel.cp` split each sequence; the data-parallel degree is what is left. Ranks of one
TP group are consecutive (`tp_inner`, the default): torchrun numbers a node's ranks consecutively, so TP, the axis
that talks inside every layer, stays inside a node, as torchtitan and Megatron order their meshes; `tp_inner=false`
puts TP across nodes and DP inside, so the reason can be measured. The launcher checks a job with this module
before any rank starts; each rank builds its torch DeviceMesh from the same arithmetic (ddp_lab/parallel/mesh.py),
and analysis reads it back from results.json.

A model says how tensor parallelism splits it with a plan (`tp_plan()` on the model class: module name -> style
below), as torchtitan's `parallelize` does per model; the lab's own layers (ddp_lab/tensor_parallel/) and torch's
DTensor plan are both built from it, so the two implementations split the same model the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from ddp_lab.spec.choices import Choice
from ddp_lab.spec.context import DEFAULT_ULYSSES, CPImpl
from ddp_lab.spec.experts import EPImpl
from ddp_lab.spec.pipeline import PPImpl, PPSchedule


class TPImpl(Choice):
    lab = "lab"
    """The lab's own Megatron-style layers (ddp_lab/tensor_parallel/lab.py)."""
    torch = "torch"
    """torch's DTensor `parallelize_module` with torchtitan's plan (ddp_lab/tensor_parallel/torch_plan.py)."""


@dataclass
class ParallelConfig:
    """The axes beyond data parallelism (ddp_lab/spec/parallel.py, ddp_lab/spec/pipeline.py,
    ddp_lab/spec/context.py, ddp_lab/spec/experts.py). `world_size = pp x dp x cp x tp`; dp is derived, and ep is
    borrowed from dp x cp."""

    tp: int = 1
    """Tensor-parallel degree: each layer's weights split over this many ranks; must divide world_size, the
    model's heads and d_ff. 1: no tensor parallelism, every rank holds the whole model."""
    tp_impl: TPImpl = TPImpl.lab
    """lab: the hand-written Megatron layers; torch: DTensor's parallelize_module with torchtitan's plan."""
    sequence_parallel: bool = False
    """Norms (and the residual stream) on sequence shards: each all-reduce of tensor parallelism becomes an
    all-gather before and a reduce-scatter after its region, same bytes, 1/tp of the norms' activations.
    Needs parallel.tp > 1 and a context length that divides by it."""
    tp_inner: bool = True
    """TP ranks consecutive (inside a node, as torchtitan and Megatron order them); false: TP across nodes,
    DP inside, to measure why TP stays inside."""
    pp: int = 1
    """Pipeline stages' ranks: the model's blocks split over this many ranks (the embedding with the first, the
    norm and output with the last), the outermost axis. 1: no pipeline."""
    pp_schedule: str = PPSchedule.one_f_one_b.value
    """gpipe, 1f1b, interleaved_1f1b (with stages_per_rank >= 2), zero_bubble (ZB-H1's split backward). A string,
    not an enum node: OmegaConf takes an enum by its member's name, and `1f1b` cannot be one (the launcher checks
    it is one of spec/pipeline.py's PPSchedule)."""
    pp_impl: PPImpl = PPImpl.lab
    """lab: the hand-written schedules over point-to-point sends and receives; torch: torch.distributed.pipelining's
    PipelineStage and the schedule of the same name."""
    microbatches: Optional[int] = None
    """Micro-batches each data-parallel rank's batch is split into for the pipeline (it must divide that batch);
    the bubble is (pp-1)/(m+pp-1) of a step for GPipe and 1F1B. Unset: one per stage (pp x stages_per_rank), the
    fewest torch's Schedule1F1B takes."""
    stages_per_rank: int = 1
    """Virtual stages per rank (interleaved_1f1b): the bubble divided by them, more sends and receives."""
    stage_layers: Optional[Any] = None
    """Blocks per stage, in stage order (pp x stages_per_rank entries, each >= 1, summing to the model's blocks);
    `auto`: split by FLOPs, the first stage's embedding and the last stage's norm, head and loss counted, so the most
    expensive stage is as cheap as it can be (spec/pipeline.py's balanced_counts); unset: as even as the blocks
    split."""
    cp: int = 1
    """Context-parallel degree: every sequence split over this many ranks for every layer, attention included
    (docs/context.md). Its ranks hold the same weights: the strategy averages gradients over dp x cp. 1: none."""
    cp_impl: CPImpl = CPImpl.ring
    """ring (contiguous split), zigzag (balanced causal work), ulysses (all-to-all to heads), hybrid (Ulysses
    inside groups of cp_ulysses, the ring across), torch (torch's ring template over the zigzag split)."""
    cp_ulysses: int = DEFAULT_ULYSSES
    """parallel.cp_impl=hybrid: the ranks of one Ulysses group (it divides cp; the ring has cp / cp_ulysses)."""
    ep: int = 1
    """Expert-parallel degree: a mixture's experts split over this many ranks, borrowed from the data-parallel ones
    (dp x cp, as torchtitan borrows them; world_size is unchanged); it divides dp x cp and model.experts. Each expert's
    copies are on the other dp x cp / ep ranks (docs/experts.md). 1: every rank holds every expert."""
    ep_impl: EPImpl = EPImpl.lab
    """lab: the exchange written by hand (any dtype); torch: torch's differentiable all-to-all and grouped matmuls."""


@dataclass(frozen=True)
class MeshLayout:
    """The (pp, dp, cp, tp) grid of a job: which ranks share each axis. `world_size = pp x dp x cp x tp`; the
    pipeline axis is outermost (as torchtitan orders it: a stage's ranks consecutive), context parallelism between
    dp and tp (torchtitan's order too), TP inside DP unless `tp_inner` is False (then TP outermost in a stage).
    A cp index is called a "replica" index together with dp's where both hold the same weights: the strategy
    averages over the dp x cp ranks of one (pp, tp) place.

    Expert parallelism is not a fifth grid dimension but a view over those replicas, as torchtitan borrows it from
    dp_shard x cp: the `dp x cp` replica indices of one (pp, tp) place, in order, cut into consecutive runs of `ep`
    (an expert-parallel group: each holds its share of the experts) and, across the runs, the ranks at the same
    place of each run (an expert-data-parallel group: each holds the same experts, which its strategy averages).
    This class is the one home of the arithmetic: the data-parallel size is derived here and nowhere else."""

    world_size: int
    tp: int = 1
    tp_inner: bool = True
    pp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def replicas(self) -> int:
        """The ranks holding the same dense weights, which the strategy averages over: dp x cp."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """The ranks holding the same experts (an expert-data-parallel group): dp x cp / ep."""
        return self.replicas // self.ep

    @property
    def stage_ranks(self) -> int:
        """Ranks per pipeline stage: dp x cp x tp."""
        return self.world_size // self.pp

    def _within(self, rank: int) -> tuple[int, int, int]:
        """(dp index, cp index, tp index) of a global rank, within its pipeline stage."""
        rank %= self.stage_ranks
        replica, tp = (rank // self.tp, rank % self.tp) if self.tp_inner else (rank % self.replicas,
                                                                              rank // self.replicas)
        return replica // self.cp, replica % self.cp, tp

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(dp index, tp index) of a global rank, within its pipeline stage."""
        dp, _, tp = self._within(rank)
        return dp, tp

    def cp_index(self, rank: int) -> int:
        """The context-parallel rank of a global rank: which tokens of every sequence it holds."""
        return self._within(rank)[1]

    def pp_index(self, rank: int) -> int:
        """The pipeline rank (which stage, or stages) of a global rank."""
        return rank // self.stage_ranks

    def replica_index(self, rank: int) -> int:
        """The place of a global rank among the dp x cp ranks holding its dense weights (dp major, cp minor)."""
        dp, cp, _ = self._within(rank)
        return dp * self.cp + cp

    def ep_index(self, rank: int) -> int:
        """Which share of the experts a global rank holds (its place in its expert-parallel group)."""
        return self.replica_index(rank) % self.ep

    def rank_at(self, *, dp: int, tp: int, pp: int, cp: int) -> int:
        """The global rank at these coordinates. Keyword-only and every axis named: a caller written before an axis
        existed fails here instead of silently taking its index 0."""
        replica = dp * self.cp + cp
        within = replica * self.tp + tp if self.tp_inner else tp * self.replicas + replica
        return pp * self.stage_ranks + within

    def _at_replica(self, replica: int, tp: int, pp: int) -> int:
        return self.rank_at(dp=replica // self.cp, cp=replica % self.cp, tp=tp, pp=pp)

    def grid(self) -> list[list[list[list[int]]]]:
        """grid[k][i][c][j]: the global rank at pp index k, dp index i, cp index c, tp index j (a DeviceMesh's mesh,
        dims (pp, dp, cp, tp))."""
        return [[[[self.rank_at(dp=i, tp=j, pp=k, cp=c) for j in range(self.tp)] for c in range(self.cp)]
                 for i in range(self.dp)] for k in range(self.pp)]

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_at(dp=i, tp=j, pp=k, cp=c) for j in range(self.tp)]
                for k in range(self.pp) for i in range(self.dp) for c in range(self.cp)]

    def cp_groups(self) -> list[list[int]]:
        return [[self.rank_at(dp=i, tp=j, pp=k, cp=c) for c in range(self.cp)]
                for k in range(self.pp) for i in range(self.dp) for j in range(self.tp)]

    def dp_groups(self) -> list[list[int]]:
        """The ranks each data-parallel strategy synchronizes over: dp x cp of one (pp, tp) place (context-parallel
        ranks hold the same weights, and each saw only its tokens)."""
        return [[self._at_replica(r, j, k) for r in range(self.replicas)]
                for k in range(self.pp) for j in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_at(dp=i, tp=j, pp=k, cp=c) for k in range(self.pp)]
                for i in range(self.dp) for c in range(self.cp) for j in range(self.tp)]

    def ep_groups(self) -> list[list[int]]:
        """The expert-parallel groups: `ep` consecutive replicas of one (pp, tp) place, which split the experts and
        send each other their tokens."""
        return [[self._at_replica(run * self.ep + e, j, k) for e in range(self.ep)]
                for k in range(self.pp) for j in range(self.tp) for run in range(self.edp)]

    def edp_groups(self) -> list[list[int]]:
        """The expert-data-parallel groups: the ranks of one (pp, tp) place holding the same experts (the same place
        in every expert-parallel group), over which a strategy averages the experts' gradients."""
        return [[self._at_replica(run * self.ep + e, j, k) for run in range(self.edp)]
                for k in range(self.pp) for j in range(self.tp) for e in range(self.ep)]

    def label(self) -> str:
        """`dp x tp` (`dp x tp x pp` with a pipeline; `-cpN` with context parallelism, `-epN` with expert
        parallelism), as tables show a mesh."""
        pipeline, context = f"x{self.pp}" if self.pp > 1 else "", f"-cp{self.cp}" if self.cp > 1 else ""
        return f"{self.dp}x{self.tp}{pipeline}{context}" + (f"-ep{self.ep}" if self.ep > 1 else "")

    def describe(self) -> dict:
        """The mesh as results.json's summary records it."""
        return {"dp": self.dp, "tp": self.tp, **({"pp": self.pp} if self.pp > 1 else {}),
                **({"cp": self.cp} if self.cp > 1 else {}), **({"ep": self.ep} if self.ep > 1 else {}),
                "label": self.label(), "tp_inner": self.tp_inner}


def layout_of(cfg) -> MeshLayout:
    """The mesh of a run's config (a composed config, the one a rank reads, results.json's); a config without a
    `parallel` node (older results, the tests' own) is data parallel only."""
    parallel = cfg.get("parallel") if hasattr(cfg, "get") else None
    if parallel is None:
        return MeshLayout(int(cfg["world_size"]))
    return MeshLayout(int(cfg["world_size"]), int(parallel.get("tp", 1)), bool(parallel.get("tp_inner", True)),
                      int(parallel.get("pp", 1) or 1), int(parallel.get("cp", 1) or 1),
                      int(parallel.get("ep", 1) or 1))


def checkpointing_problem(activation_checkpointing: str, pp: int = 1, pp_schedule: str = "1f1b") -> str | None:
    """Why `train.activation_checkpointing` cannot run with this mesh, in one line, or None: the launcher's refusal
    and the planner's, one text. Every axis and compile are proven (tests/parity/test_activation_checkpointing*.py,
    test_compile_mesh.py) but the zero-bubble schedule under `selective`, which torch refuses."""
    if activation_checkpointing == "selective" and pp > 1 and pp_schedule == "zero_bubble":
        return ("train.activation_checkpointing=selective with parallel.pp_schedule=zero_bubble: the schedule runs "
                "each backward in two halves (the input's gradient, then the weights'), and torch's selective "
                "checkpoint allows one backward per region ('Trying to backward an extra time'): use "
                "train.activation_checkpointing=full, or another schedule")
    return None


def grad_error_problem(pp: int = 1, pp_schedule: str = "1f1b") -> str | None:
    """Why `measure.grad_error` cannot measure on this mesh, in one line, or None (tests/parity/test_grad_error_mesh.py
    proves every other axis)."""
    if pp > 1 and pp_schedule == "zero_bubble":
        return ("measure.grad_error=true with parallel.pp_schedule=zero_bubble: the schedule's weight half sets each "
                ".grad itself (the lab's and torch's alike), so no post-accumulate-grad hook fires and the probe "
                "cannot see the rank's own gradient (it measured 0.5 for an exact strategy): use another schedule")
    return None


def compile_problem(tp: int = 1, tp_impl: str = "lab", cp: int = 1, cp_impl: str = "ring") -> str | None:
    """Why `train.compile` cannot run on this mesh, in one line, or None. Every axis compiles
    (tests/parity/test_compile_mesh.py) but two, where torch's Dynamo fails (its words quoted, with its version)."""
    from importlib.metadata import version

    if tp > 1 and tp_impl == "torch":
        return (f"train.compile=true with parallel.tp_impl=torch: the lab keeps DTensor's parameters as local tensors "
                f"and views them as DTensors in each forward (so every strategy sees plain tensors), and torch "
                f"{version('torch')}'s Dynamo fails tracing those views ('Mixing fake modes NYI'): use "
                "parallel.tp_impl=lab, or train.compile=false")
    if cp > 1 and cp_impl == "torch":
        return (f"train.compile=true with parallel.cp_impl=torch: torch {version('torch')}'s Dynamo fails tracing "
                "its ring attention ('An intermediate tensor created inside a higher-order op subgraph aliases an "
                "input or output'): use parallel.cp_impl=ring, zigzag, ulysses or hybrid, or train.compile=false")
    return None


def mesh_problem(world_size: int, tp: int, sequence_parallel: bool, context_length: int, pp: int = 1,
                 cp: int = 1) -> str | None:
    """One line saying why this mesh cannot be laid out, or None."""
    if tp < 1:
        return f"parallel.tp must be >= 1, got {tp}"
    if pp < 1:
        return f"parallel.pp must be >= 1, got {pp}"
    if cp < 1:
        return f"parallel.cp must be >= 1, got {cp}"
    if world_size % (tp * pp * cp):
        axes = [(k, v) for k, v in (("pp", pp), ("cp", cp), ("tp", tp)) if v > 1] or [("tp", tp)]
        what = (f"parallel.{axes[0][0]}={axes[0][1]}" if len(axes) == 1 else
                " x ".join(f"parallel.{k}" for k, _ in axes) + " = " + " x ".join(str(v) for _, v in axes))
        grid = " x ".join(["pp"] * (pp > 1) + ["dp"] + ["cp"] * (cp > 1) + ["tp"])
        return (f"{what} does not divide world_size={world_size}: world_size = {grid}, use a world_size that is a "
                f"multiple of {tp * pp * cp}")
    if sequence_parallel and tp == 1:
        return ("parallel.sequence_parallel=true shards the sequence over the tensor-parallel ranks: it needs "
                "parallel.tp > 1")
    if sequence_parallel and context_length % tp:
        return (f"parallel.sequence_parallel=true splits each sequence over parallel.tp={tp} ranks: "
                f"model.context_length={context_length} does not divide by it")
    return None


# --- the tensor-parallel plan's vocabulary --------------------------------------------------------------


@dataclass(frozen=True)
class Colwise:
    """An nn.Linear whose output features are split over the TP ranks (Megatron's ColumnParallelLinear): each
    rank computes its slice of the output, no collective forward; backward sums the input's gradient over
    the ranks. `chunks`: a fused projection (q, k and v in one weight) split chunk by chunk, each rank taking
    its slice of every chunk; `unit`: rows that must stay together (an attention head's), `what`: the model's
    knob that must divide (for the refusal)."""

    chunks: int = 1
    unit: int = 1
    what: str = ""


@dataclass(frozen=True)
class Rowwise:
    """An nn.Linear whose input features are split (Megatron's RowParallelLinear): each rank multiplies its
    slice, the partial outputs are summed over the ranks (all-reduce; reduce-scatter over the sequence under
    sequence parallelism), the bias added once, after the sum."""

    what: str = ""


@dataclass(frozen=True)
class VocabEmbedding:
    """An nn.Embedding whose rows (the vocabulary) are split; ids outside a rank's rows give zeros, and the
    ranks' outputs are summed (all-reduce, or reduce-scatter over the sequence). The lab pads the vocabulary
    to a multiple of tp (padded rows are never looked up); torch's DTensor splits it unevenly instead."""


@dataclass(frozen=True)
class VocabHead:
    """The output nn.Linear to the vocabulary, split by rows as Colwise: the logits stay split, and the loss is
    the vocab-parallel cross-entropy (the whole logits are never gathered); a weight tied to a VocabEmbedding
    is split alike."""


@dataclass(frozen=True)
class SequenceNorm:
    """A norm: replicated without sequence parallelism (every rank normalizes the whole activations), on its
    sequence shard with it, its weight's gradient then summed over the TP ranks."""


@dataclass(frozen=True)
class PrepareInput:
    """A module whose input is made whole once (the identity forward / sum of gradients backward; an all-gather
    of the sequence under sequence parallelism) for every column-parallel layer inside it: q, k and v, or a
    SwiGLU's w1 and w3, take one collective instead of one each (torchtitan's PrepareModuleInput)."""


Style = Union[Colwise, Rowwise, VocabEmbedding, VocabHead, SequenceNorm, PrepareInput]

SEQUENCE_DIM = 1
"""Every model maps (batch, sequence) token ids to (batch, sequence, features): the sequence is dim 1."""


def plan_problem(plan: dict[str, Style], shapes: dict[str, tuple[int, ...]], tp: int) -> str | None:
    """Why `tp` cannot split the layers of `plan` (their weights' `shapes` by module name), or None: the first
    split that does not divide, in the model's own knob where the plan names it."""
    if not plan:
        return "the model declares no tensor-parallel plan (a tp_plan() method: docs/parallelism.md)"
    for name, style in plan.items():
        shape = shapes.get(name)
        if shape is None:
            continue
        if isinstance(style, Colwise):
            rows = shape[0] // style.chunks
            if rows % (style.unit * tp):
                whole = rows // style.unit
                return (f"{name} splits {whole} {'heads' if style.unit > 1 else 'output features'} over "
                        f"parallel.tp={tp}: {style.what or 'its output features'} must divide by parallel.tp")
        elif isinstance(style, Rowwise) and shape[-1] % tp:
            return (f"{name} splits {shape[-1]} input features over parallel.tp={tp}: "
                    f"{style.what or 'its input features'} must divide by parallel.tp")
    return None


def padded_vocab(vocab: int, tp: int) -> int:
    """The lab's vocabulary padded to a multiple of `tp`, so every rank holds the same number of rows."""
    return -(-vocab // tp) * tp


# --- the tensor-parallel axis's collectives in one step -----------------------------------------------------


@dataclass(frozen=True)
class TPCollective:
    """One collective on the TP axis, as its schedule lists it: the op, the bytes handed to it (the whole
    tensor's, as `comm_bytes` counts: an all-gather's output, a reduce-scatter's input) and where it runs."""

    op: str
    nbytes: int
    phase: str
    """forward, backward or cross_entropy (the vocab-parallel loss, forward)."""
    layer: str


def tp_schedule(plan: dict[str, Style], shapes: dict[str, tuple[int, ...]], tp: int, sequence_parallel: bool,
                tokens: int, element_bytes: int = 4, partial_grads: dict[str, int] | None = None
                ) -> list[TPCollective]:
    """The TP axis's collectives of one micro-batch's forward and backward (`tokens` = its sequences x context)
    for a model's `plan` (weights' `shapes` by module name), in the order they run forward. Without sequence
    parallelism each region is entered by an identity (its backward an all-reduce of the input's gradient) and
    left by an all-reduce of the partial outputs: two per block forward, two backward (Megatron). With it each
    all-reduce is an all-gather of the sequence and a reduce-scatter, the same bytes, and the parameters kept
    whole on every TP rank but applied to its tokens only (`partial_grads`: their elements by module, a norm's
    weight, a row-parallel layer's bias) have their gradients summed over the TP ranks. The loss is
    the vocab-parallel cross-entropy: three all-reduces of one fp32 per token (the max logit, the sum of
    exponentials, the target's logit), the lab's and torch's `loss_parallel` alike; its backward is local. The
    lab's and torch's implementations issue this schedule op for op (tests/parity/test_tensor_parallel.py)."""
    if tp == 1:
        return []
    out: list[TPCollective] = []
    prepared = [name for name, style in plan.items() if isinstance(style, PrepareInput)]

    def inside_prepared(name: str) -> bool:
        return any(name.startswith(p + ".") for p in prepared)

    enter, leave = (("all_gather", "reduce_scatter") if sequence_parallel else (None, "all_reduce"))
    back_enter = "reduce_scatter" if sequence_parallel else "all_reduce"
    back_leave = "all_gather" if sequence_parallel else None
    for name, style in plan.items():
        shape = shapes.get(name)
        summed = sequence_parallel and (partial_grads or {}).get(name)
        if isinstance(style, SequenceNorm):
            if summed:
                out.append(TPCollective("all_reduce", summed * element_bytes, "backward", name))
            continue
        if isinstance(style, PrepareInput):
            width = _input_width(plan, shapes, name)
            _region_entry(out, name, tokens * width * element_bytes, enter, back_enter)
            continue
        if shape is None:
            continue
        if isinstance(style, (Colwise, VocabHead)):
            if not inside_prepared(name):
                _region_entry(out, name, tokens * shape[-1] * element_bytes, enter, back_enter)
        elif isinstance(style, Rowwise):
            nbytes = tokens * shape[0] * element_bytes
            out.append(TPCollective(leave, nbytes, "forward", name))
            if back_leave:
                out.append(TPCollective(back_leave, nbytes, "backward", name))
            if summed:
                out.append(TPCollective("all_reduce", summed * element_bytes, "backward", name))
        elif isinstance(style, VocabEmbedding):
            nbytes = tokens * shape[-1] * element_bytes
            out.append(TPCollective(leave, nbytes, "forward", name))
            if back_leave:
                out.append(TPCollective(back_leave, nbytes, "backward", name))
        if isinstance(style, VocabHead):
            per_token = tokens * 4  # fp32 logits: one float per token
            out.extend(TPCollective("all_reduce", per_token, "cross_entropy", name) for _ in range(3))
    return out


def _region_entry(out: list, name: str, nbytes: int, enter: str | None, back_enter: str) -> None:
    if enter:
        out.append(TPCollective(enter, nbytes, "forward", name))
    out.append(TPCollective(back_enter, nbytes, "backward", name))


def _input_width(plan: dict[str, Style], shapes: dict[str, tuple[int, ...]], prepared: str) -> int:
    """The input features of a PrepareInput module: those of the first column-parallel layer inside it."""
    for name, style in plan.items():
        if name.startswith(prepared + ".") and isinstance(style, Colwise) and name in shapes:
            return shapes[name][-1]
    raise ValueError(f"tensor-parallel plan: {prepared} prepares the input of no column-parallel layer")


def schedule_totals(collectives: list[TPCollective], micro_batches: int = 1) -> dict:
    """Calls and bytes per step by op (and in all), for `micro_batches` micro-batches a step."""
    by_op: dict[str, dict[str, int]] = {}
    for c in collectives:
        entry = by_op.setdefault(c.op, {"calls": 0, "bytes": 0})
        entry["calls"] += micro_batches
        entry["bytes"] += c.nbytes * micro_batches
    return {"calls": sum(e["calls"] for e in by_op.values()), "bytes": sum(e["bytes"] for e in by_op.values()),
            "by_op": by_op}
