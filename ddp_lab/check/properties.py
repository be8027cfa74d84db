"""What a wrapper claims beyond parity, held against what observe.py saw while the cases ran.

Parity cannot see sharding, bucketing or overlap: a "sharded" optimizer that keeps every state, an FSDP
that shards nothing, a "bucketed" DDP that sends one tensor at a time and an "overlapped" one that waits
for backward to end all train to the right weights. A claimed property (`--expect`, or implied: `--fsdp`
and a sharded optimizer checked by name claim `sharded`) is read from the runs of the `plain` case (torch's
layers) and `own_classes` (the user's kind of layers), every rank's:

- sharded: the optimizer state (AdamW's two moments, found in the optimizer's `state` and in every torch
  optimizer it holds, whatever the attribute's name) is kept once between the ranks, not once per rank: the
  ranks together hold at most one AdamW's state (+SLACK), and no rank holds all of it. Whole tensors dealt to
  owners cannot split evenly (the course's round-robin gives one rank 98% at 2 ranks where tensors alternate
  large and tiny), so how evenly is shown in the `seen` line, not judged: what no dealing of whole tensors
  can avoid is no fault. For an FSDP, the parameters too: the largest rank holds at most 1/N of them +SLACK
  (an FSDP splits tensors); a FAIL says which layer classes it held whole;
- overlap: some collective was launched asynchronously (`async_op=True`, isend/irecv) while backward still ran
  (in a gradient hook) with a parameter's gradient still to come after it (one issued in the last hook has nothing
  left to overlap; a blocking one stops backward until it is done);
- bucketed: fewer gradient collectives per step than trainable tensors at 25 MB buckets (or the size
  given), and, where the check chose the sizes, more at half the largest parameter than at 25 MB (the
  size is honoured).
"""

from __future__ import annotations

from ddp_lab.check.cases import case_of
from ddp_lab.check.models import MODELS
from ddp_lab.check.parity import STEPS

PROPERTIES = ("sharded", "overlap", "bucketed")
SLACK = 20.0  # percent of the whole a rank may hold beyond its 1/N
WATCHED = ("plain", "own_classes")  # the models of both kinds of layer


def claimed(expect: set[str], fsdp: bool, optimizer: bool) -> dict[str, str]:
    """Property -> why it is claimed (the flag that claims it)."""
    out = {p: "--expect" for p in PROPERTIES if p in expect}
    if fsdp:
        out.setdefault("sharded", "an FSDP")
    if optimizer:
        out.setdefault("sharded", "a sharded optimizer")
    return out


def unjudged(results: dict, prop: str = "") -> str | None:
    """Why no claim (or `prop`) can be judged from `results` (run -> each rank's result, the runs that finished), or
    None."""
    if not any(case_of(run)[0].name in WATCHED for run in results):
        return f"no run of {' or '.join(WATCHED)} finished, which a claim is read from"
    held = [seen["held"] for run, per_rank in results.items() if case_of(run)[0].name in WATCHED
            for *_, seen in per_rank] if prop == "sharded" else []
    lost = next((h["unmeasured"] for h in held if "unmeasured" in h), None)
    if lost is not None:
        return f"what each rank holds could not be measured (the check's own limit, no verdict on the code: {lost})"
    return None


def judge(prop: str, world_size: int, results: dict, fsdp: bool) -> str | None:
    """None when the runs show `prop`; else why not, in words. `results`: as `unjudged`'s."""
    watched = {run: per_rank for run, per_rank in results.items() if case_of(run)[0].name in WATCHED}
    return {"sharded": _sharded, "overlap": _overlap, "bucketed": _bucketed}[prop](world_size, watched, fsdp)


def _held(per_rank: list) -> list[dict]:
    return [seen["held"] for *_, seen in per_rank]


def _sharded(world_size: int, watched: dict, fsdp: bool) -> str | None:
    limit = 100 / world_size + SLACK
    for run, per_rank in watched.items():
        held = _held(per_rank)
        rank, top = max(enumerate(held), key=lambda h: h[1]["params_pct"] + h[1].get("kept_pct", 0))
        share = top["params_pct"] + top.get("kept_pct", 0)
        if fsdp and share > limit:
            return (f"in {run} rank {rank} holds {share:.0f}% of the parameters' bytes, more than 1/{world_size} + "
                    f"{SLACK:g}% ({limit:.0f}%): {'; and '.join(_why_held(top, held))}")
        problem = _state_kept_once(run, [h["optimizer_pct"] for h in held])
        if problem:
            return problem
    return None


def _why_held(top: dict, held: list[dict]) -> list[str]:
    """Every cause of a rank holding more than its share of the parameters (`top`: its observe.held), largest
    first: shards that are views of whole weights, tensors kept beside the shards, layers not sharded at all."""
    causes = []
    if top.get("views"):
        name, size, storage = top["views"][0]
        others = f" and {len(top['views']) - 1} more" if len(top["views"]) > 1 else ""
        causes.append(f"the shard is a view of the whole weight ({name}{others}: {_bytes(size)}, its storage "
                      f"{_bytes(storage)}; the slice keeps the whole tensor alive, .clone() it)")
    for where, pct, count, whole in top.get("kept", []):
        if whole and pct >= 1:
            causes.append(f"it keeps the gathered weights after forward ({whole} whole weight{'s' * (whole > 1)} in "
                          f"{where}, {pct:.0f}% of the parameters; free them once forward and backward are done)")
        elif pct >= 1:
            causes.append(f"it keeps {pct:.0f}% of the parameters' bytes beside its shards ({count} tensor"
                          f"{'s' * (count > 1)} in {where})")
    whole = sorted({c for h in held for c in h["whole"]})
    sharded = sorted({c for h in held for c in h["sharded"]})
    if whole and not causes:
        hint = (" (does it pick its layers by a class the check's models are not built of? Give it yours with "
                "--layers)") if not sharded else ""
        causes.append(f"it shards {', '.join(sharded) or 'no layer'} and holds {', '.join(whole)} whole{hint}")
    return causes or ["what it holds is not one weight's shard"]


def _bytes(n: int) -> str:
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


def _state_kept_once(run: str, shares: list) -> str | None:
    """Why the ranks' shares of one AdamW's state (percent each, None: none found) are not one sharded copy."""
    if all(s is None for s in shares):
        return (f"in {run} no rank holds optimizer state the check can find (the optimizer's `state`, and every torch "
                "optimizer it holds under any attribute): nothing to measure")
    shares = [s or 0.0 for s in shares]
    total, top = sum(shares), max(shares)
    each = ", ".join(f"rank {r} {s:.0f}%" for r, s in enumerate(shares))
    if total > 100 + SLACK:
        return (f"in {run} the ranks hold {total:.0f}% of one AdamW's state between them ({each}), more than 100% + "
                f"{SLACK:g}%: each piece is kept on more than one rank")
    if len(shares) > 1 and top >= 99.5:
        return f"in {run} one rank holds all of AdamW's state ({each}): nothing is sharded"
    return None


def _overlap(world_size: int, watched: dict, fsdp: bool) -> str | None:
    """Shown where some run shows it (a bucketed wrapper's 25 MB bucket may hold the whole small model, where no
    collective can overlap anything; its smaller buckets can)."""
    issued = {run: any(seen["in_backward"] for *_, seen in per_rank) for run, per_rank in watched.items()}
    if any(any(seen.get("overlapping", seen["in_backward"]) for *_, seen in per_rank) for per_rank in watched.values()):
        return None
    runs = ", ".join(watched)
    if not any(issued.values()):
        return (f"in {runs} no collective was issued during backward: each waits for backward to end "
                "(finish_gradient_synchronization), so none can overlap it")
    blocking = {run for run, per_rank in watched.items() if any(seen.get("blocking") for *_, seen in per_rank)}
    if blocking:
        return (f"in {', '.join(blocking)} the collectives issued during backward block it (called without "
                "async_op=True in a gradient hook, backward waits for each to complete), so none overlaps it")
    return (f"in {runs} every collective issued during backward came after the last gradient (in the last "
            "gradient hook): nothing was left for it to overlap")


def _bucketed(world_size: int, watched: dict, fsdp: bool) -> str | None:
    per_step = {run: sum(per_rank[0][3]["calls"].values()) / STEPS for run, per_rank in watched.items()}
    for run, calls in per_step.items():
        case, size = case_of(run)
        tensors = sum(1 for p in MODELS[case.model]().parameters() if p.requires_grad)
        if size != "small" and calls >= tensors:
            return (f"in {run} {_collectives(calls)} per step for {tensors} trainable tensors: one per tensor or "
                    "more, not buckets")
        other = run.replace("@small", "@25MB")
        if size == "small" and other in per_step and calls <= per_step[other]:
            return (f"{_collectives(calls)} per step with buckets of half the largest parameter ({run}), "
                    f"{per_step[other]:g} with 25 MB ({other}): the bucket size is not honoured")
    return None


def _collectives(n: float) -> str:
    return f"{n:g} collective{'' if n == 1 else 's'}"


def describe_claim(prop: str, why: str, sizes_chosen: bool = True) -> str:
    """What the line of a claimed property says it checked (`sizes_chosen`: the check ran two bucket sizes, so
    it saw whether smaller buckets mean more collectives)."""
    what = {"sharded": f"the ranks hold one copy of the optimizer state between them (at most 100% + {SLACK:g}%), "
                       f"no rank all of it (and, for an FSDP, each at most 1/N + {SLACK:g}% of the parameters)",
            "overlap": "a collective is launched asynchronously during backward with gradients still to come, which it "
                       "can overlap",
            "bucketed": "fewer collectives than tensors" + (", and more with smaller buckets" if sizes_chosen else
                                                             " at the bucket size given")}[prop]
    return f"claimed ({why}): {what}"

