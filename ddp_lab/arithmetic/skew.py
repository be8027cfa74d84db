"""Who made whom wait: each collective's stamps on every rank split into skew and transfer, and the straggler.

Every rank stamps each collective it takes part in (strategies/comm_stats.py): when it entered (launched it)
and when it completed on that rank, on one host clock (`perf_counter`, CLOCK_MONOTONIC: one clock for every
process of a host, emulated nodes included; ranks on different hosts have different clocks, and no figure
here is made from them). The k-th collective of a step is the same collective on every rank: they are issued
in one order (gloo and NCCL require it). For collective c, with A_c its last arrival (the moment it can
move data):

- skew_c = A_c - first arrival: the time the first rank waited for the last;
- transfer_c = completion on the first-arriving (most-waiting) rank - A_c.

So skew_c + transfer_c is the collective's time on its most-waiting rank; exact when that rank completes
after the last arrival (an all-reduce always does; a broadcast's root may finish sending before a receiver
enters: its transfer is then 0 and the sum the skew).

Per rank per step: `waiting` is the time inside collectives before their last arrival that is not also a
transfer of another collective, `transferring` the union of [max(entry, A_c), completion]; the two add up
to the rank's comm_ms (the union of its collectives' [entry, completion]).

Blame: the last-arriving rank of c alone held the others for A_c minus the second-to-last arrival, less the
lag it carried in (a collective before it that completed later on it than on the others: the path into it,
not the rank; `late_arrivals`). A rank's blame in a step is the union of those spans over the collectives it
arrived last at: what the step would lose if that rank's own work were as fast as the next slowest's. Each
step, the rank with the most blame `held` the others. The straggler is the rank that held them in the most
measured steps, named when that is more steps than chance gives one of N ranks of one speed (`chance` at
most ALPHA: a consistency test, step by step, so that a rank late by chance in a few steps, however long,
is not named) and its blame is at least STRAGGLER_SHARE of the step (a rank that costs less is not worth
naming). Where no rank stands out and the ranks are on several nodes, the same rule runs on the nodes (a
node's arrival at a collective is its last rank's): a slow node whose ranks share the lateness.

Why it was late (`lateness`): at each collective it arrived last at, its lateness (its entry minus the others'
median entry) is split into `link`, the part it carried in, and `work`, the rest (its own work took longer).
The cause is `link` when that part is most of it; else `data` when its draw of the batch explains it,
`compute` when its forward and backward (or its work between collectives) do.

Which collective a rank waited for after backward, and why: `exposure`.
"""

from __future__ import annotations

from collections import Counter
from math import exp, lgamma, log, log1p
from statistics import mean, median

from ddp_lab.arithmetic.intervals import merge, subtract, total

Stamps = list[list[tuple[float, float]]]
"""One step: stamps[rank][k] = (entry, completion) of the rank's k-th collective, host seconds."""

ALPHA = 0.01
"""A rank is named only when chance would make some one of N ranks of one speed hold the others in as many of
the measured steps with probability at most this (`chance`)."""
STRAGGLER_SHARE = 0.02
"""...and its blame is at least this share of the step: below it, not worth naming (module docstring)."""
HELD_MS = 1e-6
"""Blame under a nanosecond a step is the rounding of host seconds: it holds no one."""
CAUSE_SHARE = 0.5
"""A cause is named when the straggler's own excess in that phase over the other ranks' median explains at
least this share of its blame."""


def arrivals(stamps: Stamps) -> list[float]:
    """Each collective's last arrival: the moment it can move data."""
    return [max(s[k][0] for s in stamps) for k in range(len(stamps[0]))]


def aligned(stamps: Stamps) -> bool:
    """Every rank stamped the same number of collectives (else they cannot be matched one to one)."""
    return len(stamps) > 1 and len({len(s) for s in stamps}) == 1 and len(stamps[0]) > 0


def per_collective(stamps: Stamps) -> list[dict]:
    """Each collective: skew_ms, transfer_ms and its time on the most-waiting rank (`waited_ms`). Who arrived
    last, and how long it held the others: `late_arrivals`."""
    out = []
    for k in range(len(stamps[0])):
        entries = [s[k][0] for s in stamps]
        first, arrival = min(range(len(entries)), key=entries.__getitem__), max(entries)
        out.append({"skew_ms": (arrival - entries[first]) * 1e3,
                    "transfer_ms": max(0.0, stamps[first][k][1] - arrival) * 1e3,
                    "waited_ms": (stamps[first][k][1] - entries[first]) * 1e3})
    return out


def per_rank(stamps: Stamps) -> list[dict]:
    """Each rank: `waiting_ms` (for late peers) and `transferring_ms`, adding up to its comm_ms."""
    last = arrivals(stamps)
    out = []
    for mine in stamps:
        waits = [(entry, min(arrival, end)) for (entry, end), arrival in zip(mine, last)]
        moving = merge((max(entry, arrival), end) for (entry, end), arrival in zip(mine, last))
        out.append({"waiting_ms": total(subtract(waits, moving)) * 1e3, "transferring_ms": total(moving) * 1e3})
    return out


def late_arrivals(stamps: Stamps) -> list[dict]:
    """Per collective, its last-arriving rank (`rank`), the second-to-last entry and its own (`second`, `entry`,
    host seconds), its lateness (its entry minus the others' median entry) and the part of it that it carried
    in (`carried`): the most by which a collective it had seen complete before entering completed later on it
    than on the others (the transfer into it ended late), at most the lateness. Any earlier collective of the
    step, not only the one just before in issue order: fsdp issues a prefetch between a wait and the work that
    wait releases, and the prefetch completes on time behind that work. A rank late only in its own work
    completes every collective with the others (the last arrival releases everyone together): it carries
    nothing. The first collective of a step has none before it here (its batch's draw, its forward)."""
    out = []
    for k in range(len(stamps[0])):
        entries = [s[k][0] for s in stamps]
        order = sorted(range(len(stamps)), key=entries.__getitem__)
        last, others = order[-1], order[:-1]
        late = entries[last] - median(entries[r] for r in others)
        behind = [stamps[last][j][1] - median(stamps[r][j][1] for r in others)
                  for j in range(k) if stamps[last][j][1] <= entries[last]]
        out.append({"rank": last, "second": entries[order[-2]], "entry": entries[last], "late": late,
                    "carried": min(late, max([0.0, *behind]))})
    return out


def blame(stamps: Stamps, arrived: list[dict] | None = None) -> list[float]:
    """Each rank's blame in ms: the union, over the collectives it arrived last at, of [second-to-last arrival,
    its arrival less the lag it carried in]: how long its own lateness held the others. A lag carried in is
    the path into the rank, not the rank: on 2 emulated nodes the ring's two ranks that receive over the
    node link complete later than the others every step, clean jobs too (docs/benchmarks.md "Stragglers").
    `arrived`: `late_arrivals(stamps)`, where already made."""
    held: list[list[tuple[float, float]]] = [[] for _ in stamps]
    for c in arrived or late_arrivals(stamps):
        held[c["rank"]].append((c["second"], c["entry"] - c["carried"]))
    return [total(spans) * 1e3 for spans in held]


def lateness(stamps: Stamps, arrived: list[dict] | None = None) -> dict:
    """Each rank's lateness (ms) at the collectives it arrived last at, summed and split (`late_arrivals`):
    `link`, the lag it carried in (the transfer into it ended late); `work`, the rest (its own work took
    longer)."""
    out = {"link": [0.0] * len(stamps), "work": [0.0] * len(stamps)}
    for c in arrived or late_arrivals(stamps):
        out["link"][c["rank"]] += c["carried"] * 1e3
        out["work"][c["rank"]] += (c["late"] - c["carried"]) * 1e3
    return out


def node_stamps(stamps: Stamps, nodes: list[int]) -> Stamps:
    """The stamps of the nodes: each collective's last entry and last completion among the node's ranks
    (`nodes[rank]`: the rank's node)."""
    groups = [[r for r, n in enumerate(nodes) if n == node] for node in sorted(set(nodes))]
    return [[(max(stamps[r][k][0] for r in ranks), max(stamps[r][k][1] for r in ranks))
             for k in range(len(stamps[0]))] for ranks in groups]


def step_evidence(stamps: Stamps) -> dict:
    """One step's evidence of who made whom wait, from its stamps: each one's blame, the collectives it arrived
    last at, its lateness split into link and work (lists indexed like `stamps`)."""
    arrived, last = late_arrivals(stamps), [0] * len(stamps)
    for c in arrived:
        last[c["rank"]] += 1
    late = lateness(stamps, arrived)
    return {"blame": blame(stamps, arrived), "last": last, "late_link": late["link"], "late_work": late["work"]}


def step_figures(stamps: Stamps) -> dict:
    """One step's figures (spec/figures.py): the skew (the union over collectives of [first, last arrival]),
    and the most-waiting rank's time waiting for peers against transferring."""
    if not aligned(stamps):
        return {}
    spans = [(min(s[k][0] for s in stamps), max(s[k][0] for s in stamps)) for k in range(len(stamps[0]))]
    ranks = per_rank(stamps)
    most = max(range(len(ranks)), key=lambda r: ranks[r]["waiting_ms"])
    return {"skew_ms": total(spans) * 1e3, "peer_wait_ms": ranks[most]["waiting_ms"],
            "transfer_ms": ranks[most]["transferring_ms"]}


LATE_PEER = "a late peer"
ISSUED_AFTER = "issued after backward ended"
ISSUED_LATE = "issued late: backward left it less time than its transfer took"
QUEUED = "queued behind earlier collectives on the link"


def exposure(stamps: Stamps, windows: list[tuple[float, float]]) -> tuple[int, list[dict]]:
    """Which collective a rank waited for after backward, and why: (the most exposed rank, its collectives).

    `windows[rank]` = (backward's end, the gradient sync's end): the rank's exposed window. Collectives
    complete in issue order, so at each moment of the window the rank waits for the earliest one not yet
    complete: collective c's exposure is [max(backward's end, the previous completion, its issue), its
    completion] within the window (before its issue the rank was not waiting for it, but preparing it).
    It could move data once issued here (entry), entered by the last rank (arrival) and the collectives
    before it done (the link free); why it was exposed: `a late peer` when waiting for the
    last rank's entry, or `queued` when waiting for the link, is at least half its exposure; else it was
    `issued after backward ended` (its gradients came last: the bucket of the first layers) or `issued late`
    (backward left it less time than its transfer took)."""
    last, rows_by_rank = arrivals(stamps), []
    for mine, (backward_end, sync_end) in zip(stamps, windows):
        rows, previous = [], float("-inf")  # the latest completion of the collectives before this one
        for (entry, done), arrival in zip(mine, last):
            exposed = max(0.0, min(done, sync_end) - max(previous, backward_end, entry))
            peer = max(0.0, arrival - max(entry, previous))  # how long the last rank's entry held it
            queued = max(0.0, previous - max(entry, arrival))  # how long the link held it
            why = (None if exposed <= 0 else LATE_PEER if peer >= exposed / 2 else QUEUED if queued >= exposed / 2
                   else ISSUED_AFTER if entry >= backward_end else ISSUED_LATE)
            rows.append({"exposed_ms": exposed * 1e3, "issued_before_end_ms": (backward_end - entry) * 1e3,
                         "why": why})
            previous = max(previous, done)
        rows_by_rank.append(rows)
    most = max(range(len(stamps)), key=lambda r: sum(row["exposed_ms"] for row in rows_by_rank[r]))
    return most, rows_by_rank[most]


def exposure_table(steps: list[list[dict]], sizes: list[int]) -> list[dict]:
    """Per collective (issue order) over a job's measured steps: its bytes, mean exposed ms, mean ms issued
    before backward's end, and the most common why among the steps it was exposed in."""
    out = []
    for k, nbytes in enumerate(sizes):
        rows = [step[k] for step in steps if k < len(step)]
        whys = Counter(row["why"] for row in rows if row["why"])
        out.append({"collective": k, "bytes": nbytes, "exposed_ms": mean(row["exposed_ms"] for row in rows),
                    "issued_before_end_ms": mean(row["issued_before_end_ms"] for row in rows),
                    "why": whys.most_common(1)[0][0] if whys else None})
    return out


def evidence(steps: list[dict]) -> dict:
    """Per rank, over a job's measured steps: blame_ms, late_link_ms, late_work_ms, data_ms, compute_ms (means),
    `last`, the collectives it arrived last at, and `held`, the steps in which its blame was the most (counts);
    `steps`, how many were measured, and their mean step_ms; and where the ranks are on several nodes, the same
    per node (`per_node`, from the node stamps; `nodes`: each rank's node).

    `steps`: per step {"step_ms", "phases": {"data": [ms per rank], "compute": [ms per rank]}} with the ranks'
    `step_evidence` ("blame", "last", and "late_link", "late_work" where measured), and optionally "nodes"
    (each rank's node) and "per_node" (the nodes' `step_evidence`) (rank/straggler.py gathers them)."""
    out = {"per_rank": _means([{**s, **s["phases"]} for s in steps]),
           "steps": len(steps), "step_ms": mean(s["step_ms"] for s in steps)}
    if steps[0].get("per_node"):
        out["per_node"] = _means([s["per_node"] for s in steps])
        out["nodes"] = steps[0]["nodes"]
    return out


def _means(steps: list[dict]) -> dict:
    """blame, late_*, and phase figures: per-index means over the steps, as `<key>_ms`; last: summed; held: the
    steps in which each index's blame was the one most (a tie holds no one)."""
    out = {"held": [0] * len(steps[0]["blame"])}
    for step in steps:
        top = max(step["blame"])
        if top > HELD_MS and step["blame"].count(top) == 1:
            out["held"][step["blame"].index(top)] += 1
    for key in steps[0]:
        values = steps[0][key]
        if key == "last":
            out["last"] = [sum(s["last"][r] for s in steps) for r in range(len(values))]
        elif isinstance(values, list) and key != "nodes":
            out[f"{key}_ms"] = [mean(s[key][r] for s in steps) for r in range(len(values))]
    return out


def chance(held: int, steps: int, ranks: int) -> float:
    """The probability that, of `ranks` ranks equally likely to hold the others in each of `steps` independent
    steps, some one holds them in at least `held` (the binomial tail of one, times `ranks`: a union bound).
    Its terms in logarithms: a long job's binomial coefficients overflow a float."""
    if ranks < 2:
        raise ValueError("one rank holds nobody")
    log_p, log_q = -log(ranks), log1p(-1 / ranks)
    tail = sum(exp(lgamma(steps + 1) - lgamma(i + 1) - lgamma(steps - i + 1) + i * log_p + (steps - i) * log_q)
               for i in range(max(held, 0), steps + 1))
    return min(1.0, ranks * tail)


def steps_needed(ranks: int) -> int:
    """The fewest measured steps in which a rank holding the others in every one is named (`chance` <= ALPHA)."""
    steps = 1
    while chance(steps, steps, ranks) > ALPHA:
        steps += 1
    return steps


def _standout(group: dict, step_ms: float, steps: int) -> int | None:
    """The one (rank or node) that held the others in the most steps, if it stands out (module docstring);
    else None."""
    held = group["held"]
    who = max(range(len(held)), key=held.__getitem__)
    if held.count(held[who]) > 1 or chance(held[who], steps, len(held)) > ALPHA:
        return None
    return who if group["blame_ms"][who] >= STRAGGLER_SHARE * step_ms else None


def _cause(group: dict, who: int) -> tuple[str | None, dict]:
    """(cause, each phase's excess over the others' median) of `who` in `group` (per_rank or per_node)."""
    blamed = group["blame_ms"][who]
    excess = {}
    for phase in ("data", "compute"):
        times = group.get(f"{phase}_ms")
        if times:
            excess[phase] = times[who] - median(t for r, t in enumerate(times) if r != who)
    link, work = (group.get(f"late_{part}_ms", [0.0] * (who + 1))[who] for part in ("link", "work"))
    if link + work > 0 and link >= CAUSE_SHARE * (link + work):
        return "link", excess
    phase = max(excess, key=excess.get) if excess else None
    if phase is not None and excess[phase] >= CAUSE_SHARE * blamed:
        return phase, excess
    if work >= CAUSE_SHARE * blamed > 0:  # its own work between collectives (forward, backward, the update)
        return "compute", excess
    return None, excess


def verdict(steps: list[dict]) -> dict | None:
    """The straggler over a job's measured steps (None without steps): {"rank", "cost_ms", "share", "cause",
    "excess_ms", "last_share", "held_share", "chance"} with the evidence (`evidence`) and, on several nodes,
    its "node"; "rank" None when no rank stands out, with "node" when a node does (its ranks share the
    lateness), else "why" (too few steps to tell, or no rank stands out).

    The cause: `link` when most of its lateness is the collective before completing late on it
    (`lateness`); else the phase (data, compute) in which its own time exceeds the others' median by at least
    CAUSE_SHARE of its blame; else `compute` when its own work between collectives is that much of its blame;
    else None: it arrived late for a reason the stamps do not show."""
    if not steps:
        return None
    seen = evidence(steps)
    step_ms, ranks, nodes = seen["step_ms"], seen["per_rank"], seen.get("per_node")
    rank = _standout(ranks, step_ms, seen["steps"])
    if rank is not None:
        where = {"node": seen["nodes"][rank]} if nodes else {}
        return {"rank": rank, **where, **_finding(ranks, rank, seen), **seen}
    node = _standout(nodes, step_ms, seen["steps"]) if nodes else None
    if node is not None:
        return {"rank": None, "node": node, **_finding(nodes, node, seen), **seen}
    needed = steps_needed(len(ranks["held"]))
    why = (f"{seen['steps']} measured steps cannot tell a straggler from chance ({len(ranks['held'])} ranks need "
           f"{needed})" if seen["steps"] < needed else "no rank stands out")
    return {"rank": None, "why": why, **seen}


def _finding(group: dict, who: int, seen: dict) -> dict:
    """What the verdict says of the rank or node `who` of `group`: its cost, share of the step, cause, the
    phases' excess, its share of the last arrivals and of the steps it held the others in, and the chance of
    that many."""
    cause, excess = _cause(group, who)
    blamed, held = group["blame_ms"][who], group["held"][who]
    return {"cost_ms": blamed, "share": blamed / seen["step_ms"], "cause": cause, "excess_ms": excess,
            "last_share": group["last"][who] / max(1, sum(group["last"])), "held_share": held / seen["steps"],
            "chance": chance(held, seen["steps"], len(group["held"]))}


def traceml_rule(seen: dict) -> int | None:
    """traceml's published straggler rule (traceopt-ai/traceml#228, #253) on `evidence`: the culprit is the
    rank with the shortest visible phase (here forward + backward: traceml's FSDP phase; our timer has no
    backward lap of its own), the victim the upper-median rank by it; a finding when (victim - culprit) /
    the step is at least 10% (20%: critical). The culprit, or None."""
    visible = [c + d for c, d in zip(seen["per_rank"]["compute_ms"], seen["per_rank"]["data_ms"])]
    order = sorted(range(len(visible)), key=visible.__getitem__)
    culprit, victim = order[0], order[len(order) // 2]
    impact = (visible[victim] - visible[culprit]) / seen["step_ms"]
    return culprit if impact >= 0.10 else None


def late_start_rule(seen: dict) -> int | None:
    """HTA's late-start idea (a rank whose collectives start after the others'): the rank that arrived last
    at the most collectives, or None on a tie."""
    last = seen["per_rank"]["last"]
    top = max(last)
    return last.index(top) if top > 0 and last.count(top) == 1 else None
