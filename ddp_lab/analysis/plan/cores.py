"""A pipeline's step on this machine's shared cores, simulated: each rank runs its schedule's actions in order, and
the ranks with an action ready share the cores evenly, as Linux's scheduler shares them between runnable processes.

Why not the work over the cores: a pipeline whose last stage carries the head does most of the work on one rank,
and the scheduler gives that rank no more of a core than the others while they are runnable. The planner priced the
step as every rank's work over the cores, as if the busiest rank kept a core to itself; the check on a deeper
shape measured dp 1 x pp 4 under zero bubble at 1.45x that (the last stage busy 411 ms of a 508 ms span where its
work at a core of its own is 279: docs/measured/plan_unseen_deep.md). A rank waiting on a receive yields its core
(gloo's receive blocks), so only ranks with an action ready share them.

The actions and what each waits for are spec/pipeline.py's (`schedule_actions`, `waits_for`), as its `simulate`
runs them with a core a rank: F the previous stage's F of its micro-batch, B or I the next stage's B or I and its
own F, W its own I. Sends are free here (price.py prices them
apart). The data-parallel, tensor- and context-parallel ranks of a stage run its actions in step, so a stage
counts `ranks_per_stage` runnable ranks.
"""

from __future__ import annotations

from functools import lru_cache

from ddp_lab.spec.pipeline import schedule_actions, stage_index, waits_for

EPSILON = 1e-9


def action_cost(kind: str, forward: float, inputs: float, weights: float) -> float:
    """One action's work at a core of its own: F the stage's forward of a micro-batch, I its input's gradient, W its
    weights', B the two."""
    return {"F": forward, "B": inputs + weights, "I": inputs, "W": weights}[kind]


@lru_cache(maxsize=4096)
def shared_span(schedule: str, pp: int, microbatches: int, chunks: int, costs: tuple, ranks_per_stage: int,
                cores: int) -> float:
    """The step's compute span, ms: every rank's actions run as soon as what they wait for is done, at a rate of
    min(1, cores / runnable ranks) a rank. `costs`: (F, I, W) ms of a micro-batch at a core, by stage index (pp x
    chunks of them)."""
    orders = [schedule_actions(schedule, pp, microbatches, r, chunks) for r in range(pp)]
    stages = pp * chunks
    done: set = set()
    at, left = [0] * pp, [None] * pp
    now = 0.0
    while any(at[r] < len(orders[r]) for r in range(pp)):
        ready = [r for r in range(pp) if at[r] < len(orders[r]) and _can_start(orders[r][at[r]], r, pp, stages, done)]
        if not ready:
            raise ValueError(f"pipeline schedule {schedule} at pp={pp}, m={microbatches}: no rank can go on")
        rate = min(1.0, cores / (ranks_per_stage * len(ready)))
        for r in ready:
            if left[r] is None:
                act = orders[r][at[r]]
                left[r] = action_cost(act.kind, *costs[stage_index(r, act.chunk, pp)])
        step = min(left[r] for r in ready) / rate
        now += step
        for r in ready:
            left[r] -= step * rate
            if left[r] <= EPSILON:
                act = orders[r][at[r]]
                done.add((act.kind, act.microbatch, stage_index(r, act.chunk, pp)))
                at[r], left[r] = at[r] + 1, None
    return now


def _can_start(act, rank: int, pp: int, stages: int, done: set) -> bool:
    """Whether what `act` waits for is done (spec/pipeline.py's `waits_for`)."""
    return all(n in done for n in waits_for(act, stage_index(rank, act.chunk, pp), stages, done))
