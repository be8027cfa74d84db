"""Pipeline parallelism said without torch: the schedules as lists of actions, where each stage's layers lie, and
what a schedule costs in the bubble, simulated from the lists themselves.

A pipeline of `pp` ranks runs `pp x v` stages (v virtual stages per rank for the interleaved schedule; rank r
holds stages r, r + pp, r + 2 pp, ...: Megatron's interleaving). A schedule is, per rank, the order of its
actions on micro-batches: F (forward of a micro-batch through one of its stages), B (its whole backward), or
the two halves a zero-bubble schedule splits B into, I (the input's gradient: what the previous stage waits
for) and W (the weights' gradients: what nobody waits for). The sends and receives are implied: F receives the
activation from the previous stage and sends its output on, B and I receive the output's gradient from the next
stage and send the input's back. ddp_lab/pipeline_parallel/ runs the lists over point-to-point sends and
receives; `simulate` runs them on paper, with a cost per action, to give a schedule's own bubble and to prove it
never waits forever.

The published bubble (Huang et al. 2019 for GPipe; Narayanan et al. SC21 for 1F1B and interleaved; Qi et al.
2023 for zero bubble): (p-1)/(m+p-1) of the step for GPipe and 1F1B at m micro-batches, divided by v for
interleaved 1F1B, and what `simulate` gives for the lab's zero-bubble schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ddp_lab.spec.choices import Choice


class PPSchedule(Choice):
    gpipe = "gpipe"
    """Every micro-batch's forward, then every backward: the lecture's loop with its backward written."""
    one_f_one_b = "1f1b"
    """Warm-up forwards, then one forward and one backward in turn, then the remaining backwards: at most pp
    micro-batches' activations alive on the first stage."""
    interleaved_1f1b = "interleaved_1f1b"
    """1F1B over `parallel.stages_per_rank` virtual stages per rank: the bubble divided by them, more p2p."""
    zero_bubble = "zero_bubble"
    """ZB-H1: each backward split in two, the input's gradient (sent on at once: the previous stage waits for it
    only) and the weights' (run where the rank would otherwise wait), at 1F1B's memory."""


class PPImpl(Choice):
    lab = "lab"
    """The lab's own schedules over point-to-point sends and receives (ddp_lab/pipeline_parallel/)."""
    torch = "torch"
    """torch.distributed.pipelining's PipelineStage and the schedule of the same name."""


class Action(NamedTuple):
    kind: str
    """F, B, I or W (module docstring)."""
    microbatch: int
    chunk: int = 0
    """Which of the rank's virtual stages (0 but for interleaved)."""


def stage_index(rank: int, chunk: int, pp: int) -> int:
    """The pipeline stage of a rank's chunk: Megatron's interleaving (rank r holds r, r + pp, ...)."""
    return chunk * pp + rank


def schedule_actions(schedule: str, pp: int, microbatches: int, rank: int, chunks: int = 1) -> list[Action]:
    """One rank's actions for one step, in order."""
    m = microbatches
    if schedule == PPSchedule.gpipe:
        return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    if schedule == PPSchedule.one_f_one_b:
        return _one_f_one_b(pp, m, rank)
    if schedule == PPSchedule.zero_bubble:
        return _zero_bubble(pp, m)[rank]
    if schedule == PPSchedule.interleaved_1f1b:
        return _interleaved(pp, m, rank, chunks)
    raise ValueError(f"unknown pipeline schedule {schedule!r}; options: {', '.join(PPSchedule)}")


def _one_f_one_b(pp: int, m: int, rank: int, backward: str = "B") -> list[Action]:
    """pp - rank - 1 warm-up forwards, then a forward and a backward in turn, then the remaining backwards."""
    warmup = min(pp - rank - 1, m)
    order = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action("F", warmup + i), Action(backward, i)]
    return order + [Action(backward, i) for i in range(m - warmup, m)]


def _zero_bubble(pp: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023): 1F1B's order of forwards and input gradients (I, in B's place), each weight gradient
    (W) placed where its rank would otherwise wait, found by running the ranks on paper at equal costs (F = I =
    W), with 1F1B's memory: a rank starts a forward only while fewer than pp - rank micro-batches hold activations
    (their W not yet done). What is left of the W's runs at the end."""
    base = [_one_f_one_b(pp, m, r, backward="I") for r in range(pp)]
    out: list[list[Action]] = [[] for _ in range(pp)]
    done: dict[tuple, float] = {}
    clock, at, pending, held = [0.0] * pp, [0] * pp, [[] for _ in range(pp)], [0] * pp

    def ready(r: int) -> float | None:
        act = base[r][at[r]]
        if act.kind == "F" and held[r] >= pp - r:
            return None  # 1F1B's memory bound: a W must free a micro-batch first
        needs = [("F", act.microbatch, r - 1)] if act.kind == "F" else \
            [("F", act.microbatch, r)] + ([("I", act.microbatch, r + 1)] if r < pp - 1 else [])
        needs = [n for n in needs if n[2] >= 0]
        return None if any(n not in done for n in needs) else max([clock[r]] + [done[n] for n in needs])

    while any(at[r] < len(base[r]) or pending[r] for r in range(pp)):
        choices = []
        for r in range(pp):
            when = ready(r) if at[r] < len(base[r]) else None
            if when is not None and (when <= clock[r] or not pending[r]):
                choices.append((when, 0, r))
            elif pending[r]:
                choices.append((clock[r], 1, r))
        if not choices:
            raise ValueError(f"zero_bubble at pp={pp}, m={m}: no rank can go on")
        when, is_w, r = min(choices)
        act = pending[r].pop(0) if is_w else base[r][at[r]]
        clock[r] = when + 1.0
        done[(act.kind, act.microbatch, r)] = clock[r]
        out[r].append(act)
        if not is_w:
            at[r] += 1
            if act.kind == "I":
                pending[r].append(Action("W", act.microbatch))
            else:
                held[r] += 1
        else:
            held[r] -= 1
    return out


def _interleaved(pp: int, m: int, rank: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B (m a multiple of pp): the k-th forward of a rank runs chunk (k // pp) % v of
    micro-batch (k // (pp v)) pp + k % pp, the k-th backward the chunks in reverse; pp - rank - 1 forwards and
    (v - 1) pp more warm up, then one forward and one backward in turn."""
    total = m * v

    def forward(k: int) -> Action:
        return Action("F", (k // (pp * v)) * pp + k % pp, (k // pp) % v)

    def backward(k: int) -> Action:
        return Action("B", (k // (pp * v)) * pp + k % pp, v - 1 - (k // pp) % v)

    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def bubble_formula(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> float | None:
    """The published bubble share of a step, (p-1)/(m+p-1) (interleaved: over v); None for zero bubble, whose
    share is its own (`simulate`)."""
    share = (pp - 1) / (microbatches + pp - 1)
    if schedule in (PPSchedule.gpipe, PPSchedule.one_f_one_b):
        return share
    if schedule == PPSchedule.interleaved_1f1b:
        return (pp - 1) / (chunks * microbatches + pp - 1)
    return None


@dataclass(frozen=True)
class Simulated:
    step: float
    """The step's length in cost units."""
    busy: list[float]
    """Per rank: the time it computed."""
    peak_in_flight: list[int]
    """Per rank: the most micro-batches whose forward ran and whose backward had not (zero bubble's W: its I
    leaves the activations the weights' gradients need alive)."""

    def bubble(self, rank: int | None = None) -> float:
        """The idle share of the step: of one rank, or the mean over ranks."""
        ranks = range(len(self.busy)) if rank is None else [rank]
        return sum(1 - self.busy[r] / self.step for r in ranks) / len(ranks)


def simulate(schedule: str, pp: int, microbatches: int, chunks: int = 1, forward: float = 1.0,
             backward: float = 2.0, weight_share: float = 0.5,
             stage_costs: list[dict[str, float]] | None = None) -> Simulated:
    """Run every rank's actions on paper: each starts once its rank is free and what it needs is done (F the
    previous stage's F of the micro-batch, B or I the next stage's B or I, W its own I), costing `forward`,
    `backward` (I is `backward` x (1 - weight_share), W the rest), or with `stage_costs` what each stage's actions
    cost (`[{"F": ..., "B": ...}, ...]`, by stage index: measured ones); communication is free. Raises ValueError
    where the ranks would wait on each other forever (a schedule with a bug)."""
    orders = [schedule_actions(schedule, pp, microbatches, r, chunks) for r in range(pp)]
    stages = pp * chunks
    cost = {"F": forward, "B": backward, "I": backward * (1 - weight_share), "W": backward * weight_share}
    done: dict[tuple, float] = {}  # (kind, microbatch, stage) -> when it finished
    at, clock, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    alive, peak = [0] * pp, [0] * pp
    while any(at[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if at[r] == len(orders[r]):
                continue
            act = orders[r][at[r]]
            s = stage_index(r, act.chunk, pp)
            need = waits_for(act, s, stages, done)
            if any(n not in done for n in need):
                continue
            start = max([clock[r]] + [done[n] for n in need])
            took = cost[act.kind] if stage_costs is None else stage_costs[s][act.kind]
            clock[r] = start + took
            busy[r] += took
            done[(act.kind, act.microbatch, s)] = clock[r]
            alive[r] += 1 if act.kind == "F" else -1 if act.kind in ("B", "W") else 0
            peak[r] = max(peak[r], alive[r])
            at[r] += 1
            progressed = True
        if not progressed:
            stuck = {r: orders[r][at[r]] for r in range(pp) if at[r] < len(orders[r])}
            raise ValueError(f"pipeline schedule {schedule} at pp={pp}, m={microbatches}: the ranks wait on each "
                             f"other forever at {stuck}")
    return Simulated(max(clock), busy, peak)


def waits_for(act: Action, stage: int, stages: int, done) -> list[tuple]:
    """The (kind, microbatch, stage) actions `act`, run on `stage` of `stages`, waits for (module docstring): F the
    previous stage's F of its micro-batch; B or I its own F and the next stage's B or I, whichever that stage runs
    (`done`: the actions finished so far); W its own I."""
    if act.kind == "F":
        return [("F", act.microbatch, stage - 1)] if stage > 0 else []
    if act.kind in ("B", "I"):
        after = [_grad_of(done, act.microbatch, stage + 1)] if stage < stages - 1 else []
        return [("F", act.microbatch, stage)] + after
    return [("I", act.microbatch, stage)]


def _grad_of(done, microbatch: int, stage: int) -> tuple:
    """The action of `stage` whose end sends micro-batch's input gradient back: its B, or its I."""
    for kind in ("B", "I"):
        if (kind, microbatch, stage) in done:
            return (kind, microbatch, stage)
    return ("B", microbatch, stage)


def split_blocks(blocks: int, stages: int, stage_layers: list[int] | None = None) -> list[range]:
    """Each stage's blocks: `stage_layers` (a count per stage) or as even as they go, the first stages taking the
    remainder (the embedding goes with the first, the norm and head with the last)."""
    if stage_layers is not None:
        counts = list(stage_layers)
    else:
        counts = [blocks // stages + (1 if s < blocks % stages else 0) for s in range(stages)]
    out, start = [], 0
    for count in counts:
        out.append(range(start, start + count))
        start += count
    return out


AUTO = "auto"
"""`parallel.stage_layers=auto`: the blocks split so the stages' FLOPs are as even as they go (`balanced_counts`)."""


def balanced_counts(costs: list[float], stages: int, first: float = 0.0, last: float = 0.0) -> list[int]:
    """Blocks per stage, at least one each and in order, that make the most expensive stage as cheap as it can be:
    `costs` each block's (its FLOPs per token), `first` and `last` what the first and the last stage run beside their
    blocks (the embedding; the norm, head and loss). An exact search over where each stage ends."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the least possible most-expensive stage when stages 0..s-1 hold blocks 0..i-1
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        extra = (first if s == 1 else 0.0) + (last if s == stages else 0.0)
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    counts, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def microbatches_of(parallel) -> int:
    """The `parallel` node's (a DictConfig or a dict) micro-batches: as set, or one per stage (1 without a
    pipeline)."""
    if parallel.get("microbatches") is not None:
        return int(parallel.get("microbatches"))
    pp = int(parallel.get("pp") or 1)
    return pp * int(parallel.get("stages_per_rank") or 1) if pp > 1 else 1


def schedule_problem(pp: int, chunks: int, schedule: str, microbatches: int, impl: str = "lab") -> str | None:
    """One line saying why the `parallel` node's pipeline keys cannot go together, or None (no model needed)."""
    if schedule not in {str(s) for s in PPSchedule}:
        return f"parallel.pp_schedule must be one of {', '.join(PPSchedule)}, got {schedule}"
    if impl not in {str(s) for s in PPImpl}:
        return f"parallel.pp_impl must be one of {', '.join(PPImpl)}, got {impl}"
    if pp < 1 or chunks < 1 or microbatches < 1:
        return (f"parallel.pp, parallel.stages_per_rank and parallel.microbatches must be >= 1, got {pp}, {chunks} "
                f"and {microbatches}")
    if pp == 1:
        return (f"parallel.microbatches={microbatches} splits a pipeline's batch, and parallel.pp=1 is none: set "
                "parallel.pp > 1 (train.grad_accum_steps splits a batch without one)" if microbatches > 1 else
                f"parallel.stages_per_rank={chunks} are a pipeline's virtual stages, and parallel.pp=1 is none"
                if chunks > 1 else None)
    if chunks > 1 and schedule != PPSchedule.interleaved_1f1b:
        return (f"parallel.stages_per_rank={chunks} is interleaved 1F1B's: use parallel.pp_schedule=interleaved_1f1b "
                "or stages_per_rank=1")
    if schedule == PPSchedule.interleaved_1f1b and chunks < 2:
        return "parallel.pp_schedule=interleaved_1f1b needs parallel.stages_per_rank >= 2 (virtual stages per rank)"
    if schedule == PPSchedule.interleaved_1f1b and microbatches % pp:
        return (f"parallel.pp_schedule=interleaved_1f1b runs micro-batches in groups of parallel.pp={pp}: "
                f"parallel.microbatches={microbatches} does not divide by it")
    return _torch_schedule_problem(impl, schedule, pp, pp * chunks, microbatches)


def pipeline_problem(pp: int, chunks: int, schedule: str, microbatches: int, per_rank_batch: int, blocks: int,
                     stage_layers: list[int] | str | None, grad_accum_steps: int, impl: str = "lab") -> str | None:
    """One line saying why this pipeline cannot run on this model and batch, or None. `blocks`: the model's
    (pp_layers())."""
    problem = schedule_problem(pp, chunks, schedule, microbatches, impl)
    if problem is not None or pp == 1:
        return problem
    stages = pp * chunks
    if isinstance(stage_layers, str):
        if stage_layers != AUTO:
            return f"parallel.stage_layers must be a count of blocks per stage, or {AUTO}, got {stage_layers}"
        if stages > blocks:
            return (f"parallel.pp={pp} x parallel.stages_per_rank={chunks} = {stages} stages, more than the model's "
                    f"{blocks} blocks: use fewer stages or a deeper model")
    elif stage_layers is not None:
        if len(stage_layers) != stages:
            return (f"parallel.stage_layers lists {len(stage_layers)} stages, the pipeline has {stages} "
                    "(pp x stages_per_rank)")
        if any(c < 1 for c in stage_layers) or sum(stage_layers) != blocks:
            return (f"parallel.stage_layers={list(stage_layers)} must give every stage at least one of the model's "
                    f"{blocks} blocks, all of them")
    elif stages > blocks:
        return (f"parallel.pp={pp} x parallel.stages_per_rank={chunks} = {stages} stages, more than the model's "
                f"{blocks} blocks: use fewer stages or a deeper model")
    if per_rank_batch % microbatches:
        return (f"parallel.microbatches={microbatches} does not divide each data-parallel rank's batch of "
                f"{per_rank_batch} sequences: use a batch that is a multiple of {microbatches} per rank")
    if grad_accum_steps != 1:
        return ("train.grad_accum_steps > 1 with parallel.pp > 1: a pipeline's micro-batches are its accumulation "
                "(parallel.microbatches)")
    return None


def _torch_schedule_problem(impl: str, schedule: str, pp: int, stages: int, m: int) -> str | None:
    """What torch 2.13's schedule classes refuse at construction, said before launch."""
    if impl != PPImpl.torch:
        return None
    if schedule == PPSchedule.one_f_one_b and m < stages:
        return (f"parallel.pp_impl=torch: torch's Schedule1F1B needs parallel.microbatches >= its {stages} stages, "
                f"got {m} (the lab's 1F1B runs fewer)")
    rounds = max(1, m // pp)
    if schedule == PPSchedule.zero_bubble and m % rounds:
        return (f"parallel.pp_impl=torch: torch's ScheduleInterleavedZeroBubble runs micro-batches in rounds of "
                f"about parallel.pp={pp}: parallel.microbatches={m} does not divide into its {rounds} rounds")
    return None
