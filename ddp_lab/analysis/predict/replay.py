"""Replay one training step: compute, collectives launched as gradients become ready, what is exposed.

The step is forward, backward, the wait for communication backward did not hide (exposed), the
optimizer (with a sharded optimizer's own communication after it), and a small remainder (zero_grad,
slicing the batch). Backward is a stretch of `backward_ms` of *work*, measured in milliseconds it
takes when nothing else runs; each collective may launch once backward's work reached its
`ready_ms` and the collective before it launched (strategies launch in a fixed order), and the
collectives run one after another on one channel (a gloo work queue, an NCCL stream).

Where ranks share cores, compute and communication slow each other: while both are running,
compute advances at 1/`compute_slowdown` of its speed and a collective at 1/`comm_slowdown`
(fit.py fits them from the profiled run; 1 and 1 on hardware where they do not share anything).
Launching a collective from backward (the hook, the call, its bookkeeping) costs the compute thread
`launch_ms` of work, so backward grows by `launch_ms` per collective it launches: what makes many
small buckets slower than a few large ones where per-call latency alone would not.

Exposed communication = end of the last collective launched during backward (or queued behind it)
minus the end of backward: what `finish_gradient_synchronization()` waits for. Collectives with
`ready_ms=None` are blocking ones issued after backward (naive, flat): all of their time is exposed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Collective:
    """One call on the communication channel: `ms` long when alone; launchable once backward's
    work reached `ready_ms` (None: only after backward, blocking)."""

    ms: float
    ready_ms: float | None = None
    label: str = ""


@dataclass
class Step:
    """What a step is made of (ms of work when nothing else runs) and what slows what."""

    forward_ms: float
    backward_ms: float
    collectives: list[Collective] = field(default_factory=list)
    optimizer_ms: float = 0.0
    optimizer_comm_ms: float = 0.0   # a sharded optimizer's broadcasts / all-gathers, exposed
    other_ms: float = 0.0
    compute_slowdown: float = 1.0
    comm_slowdown: float = 1.0
    launch_ms: float = 0.0           # compute work per collective launched during backward


@dataclass(frozen=True)
class Replayed:
    step_ms: float
    backward_end_ms: float   # from the start of backward, slowed by communication in flight
    exposed_ms: float        # gradient sync wait after backward, plus optimizer comm
    comm_ms: float           # time some collective was in flight (the design's "total")
    hidden_ms: float         # comm_ms spent under backward


def replay(step: Step) -> Replayed:
    """Event-by-event replay of `step` (module docstring). Exact for piecewise-constant rates."""
    if step.compute_slowdown < 1 or step.comm_slowdown < 1:
        raise ValueError("slowdowns are factors >= 1")
    pending = [c for c in step.collectives if c.ready_ms is not None]  # in launch order
    for c in pending:
        if c.ready_ms < 0 or c.ready_ms > step.backward_ms + 1e-9:
            raise ValueError(f"collective {c.label!r} ready at {c.ready_ms} ms, "
                             f"outside backward (0-{step.backward_ms})")
    after = [c for c in step.collectives if c.ready_ms is None]
    # each launch is work on the compute thread, done before the collective starts
    pending = [Collective(c.ms, c.ready_ms + step.launch_ms * (k + 1), c.label) for k, c in enumerate(pending)]
    backward_ms = step.backward_ms + step.launch_ms * len(pending)
    t = work = hidden = 0.0      # wall time since backward began, backward work done, comm under backward
    queue: list[float] = []      # remaining alone-ms of launched collectives, in order
    nxt = 0
    while work < backward_ms:
        while nxt < len(pending) and pending[nxt].ready_ms <= work:
            queue.append(pending[nxt].ms)  # launch every collective whose gradients are ready, in order
            nxt += 1
        busy = bool(queue)
        compute_rate = 1 / step.compute_slowdown if busy else 1.0
        comm_rate = 1 / step.comm_slowdown
        target = min(pending[nxt].ready_ms, backward_ms) if nxt < len(pending) else backward_ms
        dt = (target - work) / compute_rate
        if busy and queue[0] / comm_rate < dt:
            dt = queue.pop(0) / comm_rate
            work = min(work + dt * compute_rate, target)
        else:
            work = target
            if busy:
                queue[0] -= dt * comm_rate
        t += dt
        hidden += dt if busy else 0.0
    backward_end = t
    # after backward: whatever is queued (and anything not yet launched) runs alone, then blocking calls
    tail = sum(queue) + sum(c.ms for c in pending[nxt:]) + sum(c.ms for c in after)
    exposed = tail + step.optimizer_comm_ms
    comm = hidden + exposed
    total = step.forward_ms + backward_end + tail + step.optimizer_ms + step.optimizer_comm_ms + step.other_ms
    return Replayed(step_ms=total, backward_end_ms=backward_end, exposed_ms=exposed, comm_ms=comm, hidden_ms=hidden)
