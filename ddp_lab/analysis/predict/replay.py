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
`ready_ms=None` are blocking ones issued after backward (naive, flat): all of their time is exposed,
but for `arithmetic` work queued among them (PowerSGD's phases after backward), which is compute.
A collective with `needed_ms` gates compute: backward's work cannot pass that point until it is
done (fsdp's all-gathers); compute then waits (`stalled_ms`, exposed too) and the channel runs alone.
The same stretch of work with gates replays fsdp's forward (schedule.py).
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
    needed_ms: float | None = None   # compute waits here for it to be done (None: never)
    arithmetic: bool = False         # compute queued behind the collectives it needs (a compressor's
    #                                  phases after backward): in the step, not in exposed (comm.arithmetic())


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
    hidden_ms: float         # comm_ms spent under backward while it computed
    stalled_ms: float = 0.0  # backward waiting for a gating collective (part of exposed_ms)


def replay(step: Step) -> Replayed:
    """Event-by-event replay of `step` (module docstring). Exact for piecewise-constant rates."""
    if step.compute_slowdown < 1 or step.comm_slowdown < 1:
        raise ValueError("slowdowns are factors >= 1")
    pending = [c for c in step.collectives if c.ready_ms is not None]  # in launch order
    for c in pending:
        if c.ready_ms < 0 or c.ready_ms > step.backward_ms + 1e-9:
            raise ValueError(f"collective {c.label!r} ready at {c.ready_ms} ms, "
                             f"outside backward (0-{step.backward_ms})")
        if c.needed_ms is not None and c.needed_ms < c.ready_ms:
            raise ValueError(f"collective {c.label!r} needed at {c.needed_ms} ms, before it is ready")
    after = [c for c in step.collectives if c.ready_ms is None]
    # each launch is work on the compute thread, done before the collective starts
    shift = [step.launch_ms * (k + 1) for k in range(len(pending))]
    ready = [c.ready_ms + d for c, d in zip(pending, shift)]
    needed = [None if c.needed_ms is None else c.needed_ms + d for c, d in zip(pending, shift)]
    backward_ms = step.backward_ms + step.launch_ms * len(pending)
    t = work = hidden = stalled = 0.0  # wall since backward began, work done, comm under compute, waiting
    queue: list[list] = []       # [index, remaining alone-ms] of launched collectives, in order
    done: set[int] = set()
    nxt = 0
    while work < backward_ms - 1e-12:
        while nxt < len(pending) and ready[nxt] <= work + 1e-12:
            queue.append([nxt, pending[nxt].ms])  # launch every collective whose gradients are ready, in order
            nxt += 1
        gate = min((n for i, n in enumerate(needed) if n is not None and i not in done and n >= work - 1e-12),
                   default=backward_ms)
        if gate <= work + 1e-12:  # compute waits for the gating collective; the channel runs alone
            if not queue:
                raise ValueError("a collective is needed before it is launched")
            dt = queue[0][1]
            done.add(queue.pop(0)[0])
            t += dt
            stalled += dt
            continue
        busy = bool(queue)
        compute_rate = 1 / step.compute_slowdown if busy else 1.0
        comm_rate = 1 / step.comm_slowdown
        target = min(ready[nxt], gate) if nxt < len(pending) else gate
        dt = (target - work) / compute_rate
        if busy and queue[0][1] / comm_rate < dt:
            dt = queue[0][1] / comm_rate
            done.add(queue.pop(0)[0])
            work = min(work + dt * compute_rate, target)
        else:
            work = target
            if busy:
                queue[0][1] -= dt * comm_rate
        t += dt
        hidden += dt if busy else 0.0
    backward_end = t
    # after backward: whatever is queued (and anything not yet launched) runs alone, then blocking calls
    tail = sum(r for _, r in queue) + sum(c.ms for c in pending[nxt:]) + sum(c.ms for c in after)
    arithmetic = sum(c.ms for c in after if c.arithmetic)
    exposed = tail - arithmetic + step.optimizer_comm_ms + stalled
    comm = hidden + exposed
    total = step.forward_ms + backward_end + tail + step.optimizer_ms + step.optimizer_comm_ms + step.other_ms
    return Replayed(step_ms=total, backward_end_ms=backward_end, exposed_ms=exposed, comm_ms=comm, hidden_ms=hidden,
                    stalled_ms=stalled)
