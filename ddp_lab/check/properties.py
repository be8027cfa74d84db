"""What a wrapper claims beyond parity, held against what observe.py saw while the cases ran.

Parity cannot see sharding, bucketing or overlap: a "sharded" optimizer that keeps every state, an FSDP
that shards nothing, a "bucketed" DDP that sends one tensor at a time and an "overlapped" one that waits
for backward to end all train to the right weights. A claimed property (`--expect`, or implied: `--fsdp`
and a sharded optimizer checked by name claim `sharded`) is read from the runs of the `plain` case (torch's
layers) and `own_classes` (the user's kind of layers), every rank's:

- sharded: the largest rank holds at most 1/N of the optimizer state (AdamW's two moments), and for an
  FSDP of the parameters too, plus SLACK of the whole (whole tensors dealt to owners cannot split
  evenly); a FAIL says which layer classes it held whole;
- overlap: some collective was issued while backward still ran (in a gradient hook);
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


def unjudged(results: dict) -> str | None:
    """Why no claim can be judged from `results` (run -> each rank's result, the runs that finished), or None."""
    if not any(case_of(run)[0].name in WATCHED for run in results):
        return f"no run of {' or '.join(WATCHED)} finished, which a claim is read from"
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
        shares = [("AdamW's state", max(h["optimizer_pct"] or 0.0 for h in held))]
        if fsdp:
            shares.insert(0, ("the parameters", max(h["params_pct"] for h in held)))
        for what, share in shares:
            if share > limit:
                whole = sorted({c for h in held for c in h["whole"]})
                sharded = sorted({c for h in held for c in h["sharded"]})
                kinds = (f": it shards {', '.join(sharded) or 'no layer'} and holds {', '.join(whole)} whole"
                         if fsdp and whole else "")
                return (f"in {run} a rank holds {share:.0f}% of {what}, more than 1/{world_size} + {SLACK:g}% "
                        f"({limit:.0f}%){kinds}")
    return None


def _overlap(world_size: int, watched: dict, fsdp: bool) -> str | None:
    for run, per_rank in watched.items():
        if not any(seen["in_backward"] for *_, seen in per_rank):
            return (f"in {run} no collective was issued during backward: each waits for backward to end "
                    "(finish_gradient_synchronization), so none can overlap it")
    return None


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


def describe_claim(prop: str, why: str) -> str:
    """What the line of a claimed property says it checked."""
    what = {"sharded": f"each rank holds at most 1/N (+{SLACK:g}%) of the optimizer state (and, for an FSDP, of the "
                       "parameters)",
            "overlap": "a collective is issued during backward, where it can overlap the rest of it",
            "bucketed": "fewer collectives than tensors, and more with smaller buckets"}[prop]
    return f"claimed ({why}): {what}"

