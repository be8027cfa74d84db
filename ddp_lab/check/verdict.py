"""What a case's results say, in one line: nothing when every rank trained like one process, else every
parameter that differs (the frozen, tied and unused ones first) and the cause where the case can tell it.

The cause is read from which parameters differ, from what and on which ranks, knowing the case's model
(its frozen parameters, its ties, its unused parameter), in this order:

- a rank's weights differ from rank 0's right after wrapping: the start-up broadcast;
- a frozen parameter moved: something reduced or stepped what must stay as broadcast;
- two names of one tied weight hold different values on a rank: each was synchronized apart;
- the unused parameter moved while ranks agree: it was given a gradient (zeros) one process does not
  give it, and the optimizer stepped it;
- ranks disagree after training: for a sharded optimizer (under the check's own DDP, which averages
  every gradient), an update its owner never sent; on the model with an unused parameter that is itself
  right, that parameter held back the bucket it shares; else some gradient was not averaged over every rank
  (a bucket or a parameter never reduced, a hook that never fired on one rank);
- every rank agrees and all differ from one process: for a sharded optimizer, an update that is not its
  owner's alone (averaged with the other ranks' copies), or, in the groups case where plain passed, a group's
  options dropped; else the average itself is wrong (a sum for a mean, a gradient counted twice) or a step
  differs.

A frozen parameter that moved and a broken tie explain their own parameters; what differs beyond them is read
for one more cause where it is a fault of its own (ranks that disagree, an unused parameter that moved; what
merely trained on different weights, alike on every rank, is a victim), so a run with two faults names both.

A crash is read from the rank's traceback (`crash_line`): the exception and the frame nearest the user's
code (not torch's, not this package's, not Python's own).
"""

from __future__ import annotations

import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from ddp_lab.check.models import MODELS
from ddp_lab.check.parity import ties_of
from ddp_lab.check.ranks import RanksFailed

SHOWN = 4  # names listed in a FAIL line before "and N more"
_HARNESS = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]), sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class Tolerance:
    """A compute dtype's absolute tolerance, one per parameter: twice how far one rounding of every step's gradients
    moves it (the rounding reference's spread, cases.py), at least `floor`. Twice: the wrapper's rounding and the
    reference's each count once."""

    spread: dict
    floor: float
    dtype: str

    def of(self, name: str) -> float:
        return max(self.floor, 2 * self.spread.get(name, 0.0))

    def describe(self, name: str) -> str:
        return (f"tolerance {self.of(name):.3g}: twice how far one rounding of each step's gradients in {self.dtype} "
                f"moves it, at least {self.floor:g}")


def atol_of(atol, name: str) -> float:
    """The absolute tolerance of parameter `name`: one number for every parameter, or a compute dtype's `Tolerance`."""
    return atol.of(name) if isinstance(atol, Tolerance) else atol


def _differs(got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> str | None:
    if got.shape != expected.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    if not torch.allclose(got.float(), expected.float(), atol=atol, rtol=rtol):
        return f"max |difference| {(got.float() - expected.float()).abs().max().item():.3g}"
    return None


def model_facts(model_name: str) -> dict:
    """{"frozen": names, "tied": [[names of one weight], ...], "unused": names} of a case's model."""
    model = MODELS[model_name]()
    return {"frozen": {n for n, p in model.named_parameters() if not p.requires_grad},
            "tied": ties_of(model),
            "unused": {n for n, _ in model.named_parameters() if n.startswith("unused.")}}


def _listed(names: list[str], facts: dict) -> str:
    special = facts["frozen"] | facts["unused"] | {n for names in facts["tied"] for n in names}
    ordered = sorted(names, key=lambda n: (n not in special, names.index(n)))
    more = f" and {len(ordered) - SHOWN} more" if len(ordered) > SHOWN else ""
    return ", ".join(ordered[:SHOWN]) + more


def verdict(case, per_rank: list, atol, rtol: float, optimizer: bool = False,
            plain_passed: bool | None = None, twin_passed: bool = False) -> str | None:
    """None when every rank matches; else the causes, every parameter that differs and the largest
    difference, in a line (module docstring). `per_rank`: run_cases' (started, trained, reference) per rank.
    `optimizer`: the target is a sharded optimizer under the project's own DDP (which averages every gradient),
    so what differs points at its updates, not at a gradient. `plain_passed`: whether the plain case passed in the
    same check (None: not run), which tells a group's dropped options from an update that is wrong everywhere.
    `atol`: a number, or a compute dtype's `Tolerance`; `twin_passed`: under a compute dtype, the same case passed in
    float32, so a difference every rank agrees on is the wrapper's rounding, not its average."""
    facts = model_facts(case.model)
    start0, _, reference = per_rank[0][:3]
    moved = {r: [n for n in start0 if n not in start or _differs(start[n], start0[n], 0.0, 0.0)]
             for r, (start, *_) in enumerate(per_rank)}
    if any(moved.values()):
        rank = next(r for r, names in moved.items() if names)
        return (f"the start-up broadcast: rank {rank} began from its own weights ({_listed(moved[rank], facts)} "
                "differ from rank 0's right after wrapping; a wrapper that expects every rank to start from one "
                "seed: --same-init)")
    wrong, worst, first = {}, None, None  # name -> ranks where it differs from what it must equal; the first one
    for rank, (_, state, *_) in enumerate(per_rank):
        for name, expected in reference.items():
            how = _differs(state[name], expected, atol_of(atol, name), rtol) if name in state else "missing"
            if how:
                wrong.setdefault(name, []).append(rank)
                first = first or name
                worst = worst or f"rank {rank}, {name}: {how} from the single-process reference"
    if not wrong:
        return None
    tolerance = atol.describe(first) if isinstance(atol, Tolerance) else f"tolerance {atol:g} + {rtol:g} x |expected|"
    detail = f"{_listed(list(wrong), facts)} differ ({worst}; {tolerance})"
    causes = _causes(per_rank, wrong, facts, atol, rtol, optimizer, case.groups, plain_passed, twin_passed)
    return f"{'; and '.join(causes)}: {detail}"


def _causes(per_rank: list, wrong: dict, facts: dict, atol, rtol: float, optimizer: bool = False,
            groups: bool = False, plain_passed: bool | None = None, twin_passed: bool = False) -> list[str]:
    """Every cause the differences show, each once: a frozen parameter that moved and a broken tie each explain
    their own names; what is left is read as one more cause (ranks apart, an unused parameter, or all agreeing)."""
    causes, explained = [], set()
    frozen = sorted(facts["frozen"] & set(wrong))
    if frozen:
        causes.append(f"a frozen parameter moved ({frozen[0]}): it must stay as broadcast, never reduced or stepped")
        explained |= facts["frozen"]
    for names in facts["tied"]:
        rank = next((r for r, (_, state, *_) in enumerate(per_rank)
                     if any(_differs(state[n], state[names[0]], 0.0, 0.0) for n in names[1:] if n in state)), None)
        if rank is not None:
            causes.append(f"the tie is broken on rank {rank}: {' and '.join(names)} are one weight and hold different "
                          "values (each was synchronized apart)")
            explained |= set(names)
    rest = {n: ranks for n, ranks in wrong.items() if n not in explained}
    trained0 = per_rank[0][1]
    apart = any(_differs(s[n], trained0[n], atol_of(atol, n), rtol) for n in rest for _, s, *_ in per_rank[1:]
                if n in s)
    # what differs beyond a moved frozen layer or a broken tie, alike on every rank, may be its victim (the model
    # trained on different weights); ranks that disagree, or an unused parameter that moved, are a fault of their own
    if rest and (not causes or apart or facts["unused"] & set(rest)):
        causes.append(_cause_of_rest(per_rank, rest, facts, atol, rtol, optimizer, groups, plain_passed, twin_passed))
    return causes


def _cause_of_rest(per_rank: list, wrong: dict, facts: dict, atol, rtol: float, optimizer: bool,
                   groups: bool, plain_passed: bool | None, twin_passed: bool = False) -> str:
    trained0 = per_rank[0][1]
    apart = [n for n in wrong if any(_differs(s[n], trained0[n], atol_of(atol, n), rtol) for _, s, *_ in per_rank[1:]
                                     if n in s)]
    unused = sorted(facts["unused"] & set(wrong))
    if unused and not apart:
        return (f"the unused parameter moved ({unused[0]}): no forward uses it, so one process gives it no gradient "
                "and AdamW leaves it alone; here it was stepped (given a zero gradient, which weight decay then "
                "moves?)")
    if apart and optimizer:
        return (f"the ranks disagree after training ({_listed(apart, facts)}): a parameter's update was not sent from "
                "the rank that owns it (the gradients were averaged by the check's own DDP)")
    if apart and facts["unused"] and not set(facts["unused"]) & set(wrong):
        return (f"the unused parameter ({_listed(sorted(facts['unused']), facts)}) held back what was to be sent with "
                f"it: no forward uses it, so its gradient never comes, and the parameters waiting beside it "
                f"({_listed(apart, facts)}) were never averaged (a bucket that launches only once every gradient in "
                "it is ready?)")
    if apart:
        return (f"the ranks disagree after training ({_listed(apart, facts)}): a gradient was not averaged over every "
                "rank (a bucket or a parameter never reduced?)")
    options = ("a parameter was not stepped with its own group's options (an inner optimizer built from the "
               "constructor's options alone?)")
    owner = ("an update is not its owner's alone (the check's own DDP averaged the gradients, so each owner's step was "
             "mixed with the other ranks' copies? an all-reduce of the parameters after the step where the owner "
             "should broadcast)")
    if optimizer and groups and plain_passed:
        return f"every rank agrees, and all differ from one process: {options}"
    if optimizer and groups and plain_passed is None:
        return (f"every rank agrees, and all differ from one process: {options}, or {owner} (the plain case tells them "
                "apart: it passes where only the options are lost)")
    if twin_passed:
        dtype = atol.dtype if isinstance(atol, Tolerance) else "the compute dtype"
        return (f"every rank agrees, and all differ from one process computing in {dtype} by more than its rounding "
                "moves them; the same case passes in float32, so the average is right: the wrapper rounds otherwise "
                f"than the reference does (where it casts, divides or sums in {dtype}?)")
    if optimizer:
        return f"every rank agrees, and all differ from one process: {owner}"
    return ("every rank agrees, and all differ from one process: the average is wrong (a sum for a mean, a "
            "gradient counted twice?) or a step differs")


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


def crash_line(traceback_text: str) -> str:
    """`ExceptionType: message (file:line, in function)` from a rank's traceback: the last exception, at the
    frame nearest the user's code (the innermost that is not torch's, this package's or Python's own;
    the innermost frame where every one is)."""
    lines = traceback_text.strip().splitlines()
    frames = [m for m in map(_FRAME.match, lines) if m]
    exception = next((line for line in reversed(lines) if line and not line[0].isspace()
                      and not line.startswith(("Traceback", "During handling", "The above exception"))),
                     lines[-1].strip() if lines else "an exception")
    if not frames:
        return exception
    own = [f for f in frames if not f["file"].startswith(_HARNESS) and not f["file"].startswith("<")]
    frame = (own or frames)[-1]
    path = Path(frame["file"])
    shown = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
    return f"{exception} ({shown}:{frame['line']}, in {frame['func']})"


SECONDARY = ("Connection closed by peer", "remote worker crashing", "Connection reset by peer",
             "remote worker hanging")  # gloo's words on a rank whose peer died


def worst(per_rank: list[dict], key: str) -> tuple[int, float] | None:
    """(rank, difference) of the rank whose finding `key` (a largest difference, None where it matched) is largest; None
    where every rank matched: the tensor- and expert-parallel checks' ranks report under a "rank" key."""
    found = [(r["rank"], r[key]) for r in per_rank if r.get(key) is not None]
    return max(found, key=lambda f: f[1]) if found else None


def _joining_hint() -> str:
    """The environment variables that choose gloo's network, where set: the usual reason a rank cannot join."""
    given = [f"{name}={os.environ[name]}" for name in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME") if name in os.environ]
    return f" (set here: {', '.join(given)})" if given else ""


def ended_by(exc: BaseException, timeout_s: float) -> tuple[str, str | None]:
    """What ended a set of ranks, in a line, and the failed rank's traceback where one raised: the first rank that
    raised of its own accord, before one that raised because its peer had died."""
    if isinstance(exc, RanksFailed) and exc.errors:
        first = min(range(len(exc.errors)), key=lambda i: any(s in exc.errors[i] for s in SECONDARY))
        error, rank = exc.errors[first], exc.failed_ranks[first]
        if ", in init_process_group" in error:  # ranks.py joins the group before the user's code runs
            return f"rank {rank} died joining the process group, before any of the checked code ran: " \
                   f"{error.strip().splitlines()[-1]}{_joining_hint()}", error
        return f"rank {rank} raised {crash_line(error)}", error
    if isinstance(exc, RanksFailed) and exc.timed_out:
        return (f"still running after {timeout_s:g} s: a rank waits for a collective the others never join, "
                "or for a gradient that never comes"), None
    said = getattr(exc, "last_words", None)  # a rank killed by a signal or exiting without raising
    return (f"{exc}: {said}" if said else str(exc)), None
