"""`python -m ddp_lab.check my_pkg.pipeline.one_f_one_b --pp 2,4`: does a pipeline schedule train like one process?

A schedule that does not sum a tied weight's copies may say so (`schedule.supports_ties = False`): its `tied` case is
then reported as not applicable (skip), never as ok; `--cases` may also leave `tied` out.

A schedule is a function the lab calls once per step on every stage (rank r runs stage r of `pp`), in the shape
of the lecture's homework (docs/check_pp.md):

    def schedule(stage: torch.nn.Module, step: ddp_lab.check.pipeline.Step) -> None

It runs every micro-batch's forward and backward through `stage` (the first stage takes `step.inputs`, token
ids; the others receive the previous stage's activation, `step.activation_shape` in float32, from rank r - 1;
the last computes `step.loss_fn(output, step.targets[i])`), sending activations forward and gradients back with
`torch.distributed`'s point-to-point calls, in any order it likes; when it returns, every parameter of the stage
holds the gradient of the whole batch's mean loss (each micro-batch's loss divided by their number, once), and
a weight tied across stages (`step.tied`: this stage's copy and the process group of the stages holding one)
holds the sum of its copies' gradients. The lab then steps SGD on every stage.

Each case builds the check's model (an embedding, 4 residual blocks and a head; `tied`: the head's weight the
embedding's, on the first and last stage), splits it into `pp` stages (the embedding with the first, the head
with the last, the blocks evenly), and trains 3 steps against the whole model on the whole batch in one process:
every stage's gradients after the first step and weights after the last must equal one process's, to float32
rounding. A FAIL names the cause (`pp_verdict`): the loss divided by the micro-batch count twice or not at all (the
gradients 1/m or m times one process's), a micro-batch's activations freed before its backward (backward through
a graph already freed), a tied weight whose copies were not summed, or, when the ranks hang past the timeout,
what each stage was waiting for (`Watch`: its point-to-point calls, counted per neighbour, so the micro-batch is
the count's). Measured and shown (`seen`): each stage's bubble (the share of the steps after the first it spent
blocked in a send, a receive or a wait) beside GPipe's and 1F1B's formula (p - 1) / (m + p - 1), and the peak of
the activations it held for backward, in micro-batches' worth.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddp_lab.check.cases import imported
from ddp_lab.check.ranks import RanksFailed, run_ranks
from ddp_lab.check.verdict import ended_by
from ddp_lab.check.watch import POINT_TO_POINT, WatchedWork, peer_of, standing_in
from ddp_lab.rank.activations import HeldActivations
from ddp_lab.spec.pipeline import split_blocks

VOCAB, D_MODEL, SEQUENCE, BATCH, BLOCKS = 32, 16, 6, 8, 4
STEPS, LR, SEED = 3, 0.1, 4321
ATOL, RTOL = 1e-5, 1e-4
BUBBLE_STEPS = 7  # synchronized steps the bubble is measured over (its median, and the spread beside it)
RECORD = 512  # bytes of Watch's record of the call a stage is blocked in (its JSON is about 100)


@dataclass
class Step:
    """What a schedule is given on one stage (module docstring)."""

    rank: int
    """This stage's index, which is its rank: the previous stage is rank - 1, the next rank + 1."""
    stages: int
    microbatches: int
    inputs: list[torch.Tensor] | None
    """The micro-batches' token ids on the first stage, (micro-batch, sequence) each; None elsewhere."""
    targets: list[torch.Tensor] | None
    """The micro-batches' next tokens on the last stage; None elsewhere."""
    activation_shape: tuple[int, ...]
    """What one micro-batch's activation between two stages is: (micro-batch, sequence, d_model), float32."""
    loss_fn: object
    """`loss_fn(output, target)`: one micro-batch's mean loss (cross-entropy over its tokens)."""
    tied: list[tuple[nn.Parameter, object]] = field(default_factory=list)
    """(this stage's copy of a weight tied across stages, the process group of the stages holding a copy)."""


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x):
        return x + F.gelu(self.linear(x))


class PipelineNet(nn.Module):
    """An embedding, BLOCKS residual blocks and a head: what splits into stages at pp 2 and 4."""

    def __init__(self, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def layers(self) -> list[tuple[str, nn.Module]]:
        return [("embed", self.embed), *((f"blocks.{i}", b) for i, b in enumerate(self.blocks)), ("head", self.head)]

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Stage(nn.Module):
    """Stage `rank` of `stages`: its layers of a PipelineNet, in order, under their names in the whole model."""

    def __init__(self, model: PipelineNet, rank: int, stages: int):
        super().__init__()
        blocks = list(split_blocks(BLOCKS, stages)[rank])
        self.names = (["embed"] if rank == 0 else []) + [f"blocks.{i}" for i in blocks] + \
            (["head"] if rank == stages - 1 else [])
        self.layers = nn.ModuleList(model.get_submodule(n) for n in self.names)

    def whole_names(self) -> dict[str, str]:
        """This stage's parameter names -> their names in the whole model."""
        return {f"layers.{i}.{rest}": f"{self.names[i]}.{rest}"
                for i, layer in enumerate(self.layers) for rest, _ in layer.named_parameters()}

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@dataclass(frozen=True)
class PPCase:
    name: str
    microbatches: int
    tied: bool
    proves: str


PP_CASES = {case.name: case for case in (
    PPCase("m1", 1, False, "one micro-batch: every stage's gradients and weights as one process's"),
    PPCase("m2", 2, False, "two micro-batches: each loss divided by their number once"),
    PPCase("m4", 4, False, "four micro-batches over {pp} stages: {held}"),
    PPCase("tied", 2, True, "the head's weight tied to the embedding's, a copy on the first and on the last stage: "
           "their gradients summed"),
)}


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(0, VOCAB, (BATCH, SEQUENCE + 1), generator=generator)


def run_pp_cases(rank: int, pp: int, target: str, names: list[str], progress: str) -> dict:
    """On every stage, per case: its gradients after the first step and weights after the last beside one
    process's, its bubble and activation peak; `progress`: where `Watch` writes what this rank waits for."""
    schedule = locate_function(target)
    out = {}
    for name in names:
        case = PP_CASES[name]
        torch.manual_seed(SEED)
        reference = PipelineNet(tied=case.tied)
        stage = Stage(copy.deepcopy(reference), rank, pp)
        group = dist.new_group([0, pp - 1]) if case.tied else None  # every rank makes it, in the same order
        tied = []
        if case.tied and rank in (0, pp - 1):
            tied = [(stage.layers[0].weight if rank == 0 else stage.layers[-1].weight, group)]
        tokens = batch()
        m = case.microbatches
        step = Step(rank, pp, m, [c.clone() for c in tokens[:, :-1].chunk(m)] if rank == 0 else None,
                    [c.clone() for c in tokens[:, 1:].chunk(m)] if rank == pp - 1 else None,
                    (BATCH // m, SEQUENCE, D_MODEL), loss_fn, tied)
        one = _one_microbatch_bytes(stage, step)
        optimizers = [torch.optim.SGD([p for p in mod.parameters() if p.requires_grad], lr=LR)
                      for mod in (reference, stage)]
        watch, activations = Watch(rank, Path(progress, f"rank{rank}.{name}.p2p")), HeldActivations()
        found = {"rank": rank, "microbatches": m, "one_bytes": one}
        whole = dict(reference.named_parameters(remove_duplicate=False))
        names_of = stage.whole_names()
        for i in range(STEPS):
            loss_fn(reference(tokens[:, :-1]), tokens[:, 1:]).backward()
            with watch.watching(), activations.counting():
                schedule(stage, step)
            if i == 0:
                found["grads"] = {names_of[n]: (_none_or(p.grad), whole[names_of[n]].grad.clone())
                                  for n, p in stage.named_parameters()}
                found["peak_bytes"] = activations.peak
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        found["weights"] = {names_of[n]: (p.detach().clone(), whole[names_of[n]].detach().clone())
                            for n, p in stage.named_parameters()}
        found["tied"] = [names_of[n] for n, p in stage.named_parameters() if any(p is t for t, _ in tied)]
        found["bubbles"] = _bubbles(schedule, stage, step, watch)
        out[name] = found
    return out


def _bubbles(schedule, stage: Stage, step: Step, watch: "Watch") -> list[float]:
    """This stage's bubble in each of BUBBLE_STEPS more steps (gradients only, nothing stepped), each started on every
    stage at once after a barrier: the share of the step it spent blocked in a send, a receive or a wait. A window
    that starts when this stage happens to start would count another stage's lateness as this one's bubble."""
    bubbles = []
    for _ in range(BUBBLE_STEPS):
        dist.barrier()
        start = time.perf_counter()
        with watch.watching():
            schedule(stage, step)
        spent = time.perf_counter() - start
        bubbles.append(watch.blocked_s / spent)
        stage.zero_grad(set_to_none=True)
    return bubbles


def _none_or(t):
    return None if t is None else t.detach().clone()


def locate_function(target: str):
    """The schedule function at a dotted path; ValueError saying what is wrong."""
    module_name, name, fn = imported(target, "my_pkg.pipeline.one_f_one_b")
    if fn is None or isinstance(fn, type) or not callable(fn):
        raise ValueError(f"{module_name!r} has no schedule function {name!r} (a function (stage, step) -> None)")
    return fn


def _one_microbatch_bytes(stage: Stage, step: Step) -> int:
    """What one micro-batch's forward through the stage (and its loss, on the last) saves for backward: the unit of
    the activation peak."""
    held = HeldActivations()
    x = step.inputs[0] if step.inputs is not None else torch.zeros(step.activation_shape, requires_grad=True)
    with held.counting():
        out = stage(x)
        if step.targets is not None:
            out = step.loss_fn(out, step.targets[0])
        size = held.now
    del out
    return size


class Watch:
    """This stage's point-to-point calls while `watching()`: the time blocked in them (a blocking send or receive,
    a request's wait), and, in the file `path`, the call it is blocked in right now (cleared when it returns), so
    that a hang can be told: "stage 1 waits to receive its 2nd activation from stage 0 (micro-batch 1 in order,
    tag 0)". Counted per neighbour and direction: the k-th activation a stage sends or receives is micro-batch
    k's in a schedule that keeps their order."""

    def __init__(self, rank: int, path: Path):
        self.rank, self.path, self.blocked_s = rank, path, 0.0
        self.counts: dict[tuple, int] = {}

    def _what(self, op: str, peer: int, tag: int) -> str:
        """The call about to block, as a JSON line for `waiting` to read after a hang."""
        kind = "activation" if (peer < self.rank) == (op in ("recv", "irecv")) else "gradient"
        verb = "receive" if op in ("recv", "irecv") else "send"
        key = (verb, peer, kind)
        self.counts[key] = self.counts.get(key, 0) + 1
        return json.dumps({"stage": self.rank, "verb": verb, "kind": kind, "peer": peer, "nth": self.counts[key],
                           "tag": tag})

    def _note(self, what: str) -> None:
        """The call blocked in now, written in place: one pwrite of a fixed-size record, not a file opened and
        closed per call, which would add its own time to the step the bubble is read from."""
        os.pwrite(self._fd, what.ljust(RECORD).encode(), 0)

    @contextmanager
    def blocked(self, what: str):
        self._note(what)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.blocked_s += time.perf_counter() - start
            self._note("")

    @contextmanager
    def watching(self):
        """Every point-to-point call watched: send, recv, isend and irecv, and so batch_isend_irecv's P2POps
        (watch.py's stand-ins), the peer read from dst/src, group_dst/group_src or group_peer."""
        def make(name, original):
            def call(*args, **kwargs):
                what = self._what(name, peer_of(name, args, kwargs), kwargs.get("tag", args[3] if len(args) > 3
                                                                                else 0))
                if name in ("isend", "irecv"):
                    return WatchedWork(original(*args, **kwargs), self, what)
                with self.blocked(what):
                    return original(*args, **kwargs)
            return call

        self.counts.clear()
        self.blocked_s = 0.0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT)
        try:
            with standing_in(POINT_TO_POINT, make):
                yield self
        finally:
            os.close(self._fd)


def _ordinal(k: int) -> str:
    return f"{k}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10 if k % 100 not in (11, 12, 13) else 0, 'th')}"


def waiting(progress: str, case: str, pp: int) -> str:
    """What each stage was waiting for when its ranks were stopped (Watch's files), and the cause where two
    neighbours wait on each other: sends and receives paired in a different order, or both receiving."""
    calls = {}
    for rank in range(pp):
        path = Path(progress, f"rank{rank}.{case}.p2p")
        text = path.read_text().strip() if path.exists() else ""
        calls[rank] = json.loads(text) if text else None
    told = []
    for rank, call in calls.items():
        if call is None:
            told.append(f"stage {rank} is in no send, receive or wait")
            continue
        to = "from" if call["verb"] == "receive" else "to"
        told.append(f"stage {rank} waits to {call['verb']} its {_ordinal(call['nth'])} {call['kind']} {to} stage "
                    f"{call['peer']} (micro-batch {call['nth'] - 1} in order, tag {call['tag']})")
    causes = []
    for rank, call in calls.items():
        other = calls.get(call["peer"]) if call else None
        if not other or other["peer"] != rank or rank > call["peer"]:
            continue
        if {call["verb"], other["verb"]} == {"send", "receive"} and call["tag"] != other["tag"]:
            sender, receiver = (call, other) if call["verb"] == "send" else (other, call)
            causes.append(f"sends and receives paired in a different order: stage {sender['stage']} sends tag "
                          f"{sender['tag']} while stage {receiver['stage']} waits for tag {receiver['tag']} (a "
                          "blocking send waits for its own receive)")
        elif call["verb"] == other["verb"]:
            causes.append(f"stages {rank} and {call['peer']} both wait to {call['verb']} (each waits for the other: a "
                          f"{'send' if call['verb'] == 'receive' else 'receive'} missing, or after its partner)")
    return "; ".join(causes + told)


def pp_verdict(per_rank: list[dict]) -> str | None:
    """The cause of what differs from one process, or None."""
    m = per_rank[0]["microbatches"]
    grads = {name: (got, expected) for r in per_rank for name, (got, expected) in r["grads"].items()}
    tied = {name for r in per_rank for name in r["tied"]}
    wrong = {n for n, (got, expected) in grads.items() if _differs(got, expected)}
    if not wrong:
        weights = {n for r in per_rank for n, (got, expected) in r["weights"].items() if _differs(got, expected)}
        if not weights:
            return None
        return (f"the weights after {STEPS} steps differ ({', '.join(sorted(weights))}) although the first step's "
                "gradients were right: a later step's differ (state kept between steps?)")
    untied = wrong - tied
    scales = [_scale(*grads[n]) for n in sorted(untied)] if untied else []
    if untied and m > 1 and all(abs(s - m) < 1e-3 * m for s in scales):
        return (f"the loss is not divided by the micro-batch count: every gradient is {m} times one process's (divide "
                f"each micro-batch's loss by {m}, once)")
    if untied and m > 1 and all(abs(s - 1 / m) < 1e-3 for s in scales):
        return (f"the loss is divided by the micro-batch count twice: every gradient is 1/{m} of one process's "
                "(divide each micro-batch's loss by m once, not its gradient again)")
    if not untied:
        stages = sorted(r["rank"] for r in per_rank if r["tied"])
        return (f"a tied weight's copies on stages {' and '.join(map(str, stages))} were not summed "
                f"({', '.join(sorted(tied & wrong))}: each holds only its own stage's gradient; all-reduce them over "
                "step.tied's group after backward)")
    listed = ", ".join(sorted(wrong)[:4]) + (f" and {len(wrong) - 4} more" if len(wrong) > 4 else "")
    rank = next(r["rank"] for r in per_rank if any(n in wrong for n in r["grads"]))
    return f"the gradients after the first step differ from one process's ({listed}; from stage {rank})"


def _differs(got, expected) -> bool:
    if got is None:
        return bool(expected.abs().max() > ATOL)
    return not torch.allclose(got, expected, atol=ATOL, rtol=RTOL)


def _scale(got, expected) -> float:
    if got is None:
        return 0.0
    return float((got * expected).sum() / (expected * expected).sum().clamp_min(1e-30))


def seen_line(per_rank: list[dict], pp: int) -> str:
    """Each stage's bubble beside the formula, and its activation peak in micro-batches' worth."""
    m = per_rank[0]["microbatches"]
    formula = (pp - 1) / (m + pp - 1)
    parts = []
    for r in per_rank:
        worth = f" ({r['peak_bytes'] / r['one_bytes']:.1f} micro-batches' worth)" if r["one_bytes"] else ""
        b = r["bubbles"]
        bubble = f"bubble {100 * statistics.median(b):.0f}% ({100 * min(b):.0f}-{100 * max(b):.0f}%)"
        parts.append(f"stage {r['rank']} {bubble}, activations held at most {r['peak_bytes'] / 2**10:.1f} KiB{worth}")
    return (f"{'; '.join(parts)} (GPipe's and 1F1B's bubble (p - 1) / (m + p - 1) = {100 * formula:.0f}% at p {pp}, "
            f"m {m}; measured: the median and the range over {BUBBLE_STEPS} steps, each started on every stage at "
            "once after a barrier, of the share spent blocked in sends, receives and waits, on shared CPU cores)")


# autograd's words for backward through a graph already freed, or never kept (a detached output)
FREED = ("backward through the graph a second time", "does not require grad and does not have a grad_fn")


def check_schedule(target: str, degrees: list[int], names: list[str], timeout_s: float, log_dir: str) -> list[tuple]:
    """The pipeline check of a schedule function, run from the command line: (pp, case, verdict, detail, a crashed
    rank's traceback or None) per case and degree, and a `seen` line per finished case; each case in a set of ranks
    of its own, so a hang costs that case only and is told by what each stage was waiting for."""
    fn = locate_function(target)  # refused here, in one line, before any rank starts
    lines = []
    for pp in degrees:
        for name in names:
            proves = proves_at(PP_CASES[name], pp)
            if name == "tied" and getattr(fn, "supports_ties", True) is False:
                lines.append((pp, name, "skip", "not applicable: the schedule declares it does not support a weight "
                              "tied across stages (supports_ties = False)", None))
                continue
            with tempfile.TemporaryDirectory() as progress:
                try:
                    per_rank = run_ranks(run_pp_cases, pp, target, [name], progress, timeout_s=timeout_s,
                                         log_dir=log_dir)
                except Exception as exc:  # a rank raised, died or hung
                    failure, trace = ended_by(exc, timeout_s)
                    if isinstance(exc, RanksFailed) and exc.timed_out:  # a hang: what every stage waited for
                        failure = f"still running after {timeout_s:g} s: {waiting(progress, name, pp)}"
                    m = PP_CASES[name].microbatches
                    if trace is not None and "IndexError" in trace and m < pp - 1:
                        failure = (f"a stage asked for a micro-batch that does not exist (m {m} < p - 1 = {pp - 1}: a "
                                   "1F1B's warm-up is min(p - 1 - rank, m) forwards, not p - 1 - rank): "
                                   f"{failure}")
                    if trace is not None and any(words in trace for words in FREED):
                        failure = ("a micro-batch's activations were freed before its backward (backward ran "
                                   "through a graph already freed, or never kept: keep each micro-batch's input and "
                                   f"output until its own backward): {failure}")
                    lines.append((pp, name, "FAIL", f"{proves}: FAILED: {failure}", trace))
                    continue
            results = [r[name] for r in per_rank]
            cause = pp_verdict(results)
            lines.append((pp, name, "FAIL" if cause else "ok", f"{proves}: FAILED: {cause}" if cause else proves, None))
            lines.append((pp, name, "seen", seen_line(results, pp), None))
    return lines


def proves_at(case: PPCase, pp: int) -> str:
    """A case's description at the stage count it ran at (1F1B's first stage holds min(m, pp) micro-batches)."""
    held = ("more than a 1F1B's first stage holds at once (2 of them)" if pp == 2 else
            "as many as a 1F1B's first stage holds at once" if pp == 4 else f"1F1B's first stage holds {min(4, pp)}")
    return case.proves.format(pp=pp, held=held)


def header(target: str) -> str:
    """What a schedule is checked against, the first line of the check's output."""
    return (f"{target} (a pipeline schedule, stage r on rank r) against single-process training (atol {ATOL:g}, rtol "
            f"{RTOL:g}; torch {torch.__version__}, gloo on CPU; {STEPS} SGD steps on the whole batch):")
