"""`python -m ddp_lab.check my_pkg.ring_attention --cp 2,4`: does a context-parallel attention match one process?

The contract (docs/check_cp.md): a function the lab calls on every rank of a cp group,

    def attention(q, k, v, group, causal) -> out

q, k and v are this rank's tokens of every sequence, (batch, heads, local tokens, head_dim), float64 (float32 with
`--dtype float32`, for code that runs in no other), with requires_grad; `group` is the process group of the ranks
sharing the sequence (rank r of it holds the r-th share); `causal` says whether a query sees only the keys at or
before its own position. It returns this rank's queries' attention over the whole sequence, differentiably: the lab
backpropagates a fixed gradient through it and reads q, k and v's gradients. The rank's tokens are contiguous (rank
r holds chunk r of cp); a function that takes a `layout` keyword is also checked on the zigzag split
(`layout="zigzag"`: rank r holds chunks r and 2cp-1-r of 2cp, in that order).

Each case runs the function on cp gloo ranks against `scaled_dot_product_attention` over the whole sequence on one
process, forward and every input's gradient (float64, within 1e-9; float32 inputs within 2e-5: TOLERANCES). A FAIL
names the cause where the output matches a known wrong version computed on one process: blocks merged without their
log-sum-exps (each block's softmax averaged, unweighted), the causal mask wrong off the diagonal (keys after a query
attended, or a whole block's earlier keys masked as if it were the diagonal), no mask on the diagonal block, the
right values in the wrong places (a scrambled all-to-all); or, with the output right, dK/dV not returned to their
owners (each rank keeping only what its own queries gave its keys). When the ranks hang, what each was waiting in
(`Waits`). `seen`: the bytes each rank sent (point-to-point and collectives) beside the ring's formula, and each
rank's time in the function, max over mean, beside the formula's causal imbalance for the layout.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_lab.check.cases import imported
from ddp_lab.check.ranks import RanksFailed, run_ranks
from ddp_lab.check.verdict import ended_by
from ddp_lab.check.watch import WatchedWork, peer_of, standing_in
from ddp_lab.spec.context import exchange_bytes, imbalance, positions_of

BATCH, HEADS, HEAD_DIM, CHUNK, SEED = 2, 4, 8, 4, 2024
TOLERANCES = {"float64": 1e-9, "float32": 2e-5}
"""Within what the output and gradients must equal one process's, by the dtype the function runs in (`--dtype`):
float64's rounding of one attention is about 1e-15, float32's about 1e-6 of values of order 1; a wrong version is
off by 0.1 and more."""
RECORD = 256
CP_CASES = {
    "causal": "causal attention, contiguous split: the output and dq, dk, dv equal one process's",
    "full": "attention without a mask (causal=False), contiguous split",
    "zigzag": "causal attention on the zigzag split (rank r holds chunks r and 2cp-1-r)",
}


def locate_attention(target: str):
    """The attention function at a dotted path; ValueError saying what is wrong."""
    module_name, name, fn = imported(target, "my_pkg.cp.ring_attention")
    if fn is None or isinstance(fn, type) or not callable(fn):
        raise ValueError(f"{module_name!r} has no attention function {name!r} (a function (q, k, v, group, causal) "
                         "-> out)")
    return fn


def takes_layout(fn) -> bool:
    try:
        return "layout" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def length(cp: int) -> int:
    """The sequence: 2 cp chunks of CHUNK tokens (both splits divide it)."""
    return 2 * cp * CHUNK


def inputs(cp: int, dtype: str = "float64") -> list[torch.Tensor]:
    """q, k, v and the output's gradient over the whole sequence, in `dtype`: the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(SEED)
    return [torch.randn(BATCH, HEADS, length(cp), HEAD_DIM, generator=g, dtype=torch.float64).to(getattr(torch, dtype))
            for _ in range(4)]


# --- on every rank -----------------------------------------------------------------------------------------


class Waits:
    """This rank's communication while `watching()`: bytes it sent, and in the file `path` the call it is in now
    (cleared when it returns), so that a hang can be told. Watched: send, recv, isend and irecv (and their
    requests' waits, batch_isend_irecv's too), all_to_all_single, all_to_all, all_gather,
    all_gather_into_tensor, reduce_scatter_tensor, all_reduce and broadcast, on torch.distributed and on
    torch.distributed.distributed_c10d (where P2POp and batch_isend_irecv look their ops up: on gloo a batch runs
    its isends and irecvs one by one, so they are watched there)."""

    BLOCKING = ("send", "recv", "all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor",
                "reduce_scatter_tensor", "all_reduce", "broadcast")

    def __init__(self, path: Path):
        self.path, self.sent = path, 0

    def _note(self, what: str) -> None:
        os.pwrite(self._fd, what.ljust(RECORD).encode()[:RECORD], 0)

    @contextmanager
    def blocked(self, what: str):
        self._note(what)
        try:
            yield
        finally:
            self._note("")

    def _count(self, name: str, args, kwargs) -> None:
        """Bytes handed to a send or a collective (its input: an all-to-all's or all-gather's, a reduction's)."""
        if name in ("recv", "irecv"):
            return
        second = ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_to_all")
        given = args[1] if len(args) > 1 and name in second else (args[0] if args else None)
        tensors = given if isinstance(given, (list, tuple)) else [given]
        self.sent += sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))

    @contextmanager
    def watching(self):
        def make(name, original):
            def call(*args, **kwargs):
                self._count(name, args, kwargs)
                what = json.dumps({"op": name, "peer": peer_of(name, args, kwargs)})
                if name in ("isend", "irecv") or kwargs.get("async_op"):
                    return WatchedWork(original(*args, **kwargs), self, what)
                with self.blocked(what):
                    return original(*args, **kwargs)
            return call

        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT)
        try:
            with standing_in(self.BLOCKING + ("isend", "irecv"), make):
                yield self
        finally:
            os.close(self._fd)


def run_cp_case(rank: int, cp: int, target: str, case: str, progress: str, dtype: str = "float64") -> dict:
    """One case on this rank: the function on its tokens, forward and backward; what it returned and the gradients,
    the bytes it sent and its time."""
    fn = locate_attention(target)
    layout = "zigzag" if case == "zigzag" else "ring"
    at = torch.tensor(positions_of(rank, cp, layout, length(cp)))
    q, k, v, dout = (t[:, :, at].clone() for t in inputs(cp, dtype))
    for t in (q, k, v):
        t.requires_grad_(True)
    group = dist.group.WORLD
    kwargs = {"layout": "zigzag" if case == "zigzag" else "contiguous"} if takes_layout(fn) else {}
    waits = Waits(Path(progress, f"rank{rank}.{case}.cp"))
    with waits.watching():
        start = time.perf_counter()
        out = fn(q, k, v, group, case != "full", **kwargs)
        out.backward(dout)
        took = time.perf_counter() - start
    grads = [None if t.grad is None else t.grad.detach().clone() for t in (q, k, v)]
    return {"out": out.detach().clone(), "grads": grads, "sent": waits.sent, "seconds": took}


# --- on one process: the reference and the wrong versions a cause is read from ------------------------------


def _attend(q, k, v, mask: torch.Tensor | None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def reference(cp: int, case: str, dtype: str = "float64") -> dict:
    """One process's output and gradients over the whole sequence, and the known wrong outputs, each whole: in
    float64, from the inputs as the function got them (rounded to `dtype`)."""
    n = length(cp)
    q, k, v, dout = (t.double().requires_grad_(i < 3) for i, t in enumerate(inputs(cp, dtype)))
    causal = case != "full"
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(dout)
    chunks = 2 * cp if case == "zigzag" else cp
    size = n // chunks
    whole = torch.ones(n, n, dtype=torch.bool).tril()
    wrong = {}
    with torch.no_grad():
        blocks = []  # per query chunk: the per-key-chunk outputs a ring would merge
        for i in range(chunks):
            rows = slice(i * size, (i + 1) * size)
            seen = [j for j in range(chunks) if not causal or j <= i]
            keys = [slice(j * size, (j + 1) * size) for j in seen]
            blocks.append([(j, _attend(q[:, :, rows], k[:, :, at], v[:, :, at],
                                       whole[rows, at] if causal and j == i else None)) for j, at in zip(seen, keys)])
        wrong["unweighted"] = torch.cat([sum(o for _, o in b) / len(b) for b in blocks], dim=2)
        if causal:
            diagonal = torch.ones(size, size, dtype=torch.bool).tril()
            every = torch.zeros(n, n, dtype=torch.bool)
            for i in range(chunks):
                for j in range(i + 1):
                    every[i * size:(i + 1) * size, j * size:(j + 1) * size] = diagonal
            wrong["masked_every_block"] = _attend(q, k, v, every)
            wrong["future_attended"] = _attend(q, k, v, None)
            no_diagonal = whole.clone()
            for i in range(chunks):
                no_diagonal[i * size:(i + 1) * size, i * size:(i + 1) * size] = True
            wrong["no_diagonal_mask"] = _attend(q, k, v, no_diagonal)
    return {"out": out.detach(), "grads": [t.grad for t in (q, k, v)], "wrong": wrong, "q": q.detach(),
            "k": k.detach(), "v": v.detach(), "dout": dout}


def own_queries_grads(ref: dict, rank: int, cp: int, case: str) -> list[torch.Tensor]:
    """dK and dV of this rank's keys from its own queries alone: what a ring that never returns them keeps."""
    at = torch.tensor(positions_of(rank, cp, "zigzag" if case == "zigzag" else "ring", length(cp)))
    k, v = ref["k"].clone().requires_grad_(), ref["v"].clone().requires_grad_()
    out = F.scaled_dot_product_attention(ref["q"], k, v, is_causal=case != "full")
    out[:, :, at].backward(ref["dout"][:, :, at])
    return [k.grad[:, :, at], v.grad[:, :, at]]


CAUSES = {
    "unweighted": "blocks merged without their log-sum-exps (each block's softmax averaged, unweighted: merge by "
                  "exp(lse_i - lse) weights)",
    "masked_every_block": "the causal mask wrong off the diagonal: earlier blocks masked as if each were the "
                          "diagonal (mask by global positions, or only the diagonal block)",
    "future_attended": "the causal mask wrong off the diagonal: keys after a query attended (skip the blocks later "
                       "in the sequence than the queries)",
    "no_diagonal_mask": "no causal mask on the diagonal block (a query sees the later keys of its own chunk)",
}


def _close(a, b, tolerance: float) -> bool:
    return a is not None and a.shape == b.shape and torch.allclose(a.double(), b, atol=tolerance, rtol=0)


def cp_verdict(per_rank: list[dict], cp: int, case: str, dtype: str = "float64") -> str | None:
    """The cause of a wrong case, or None when every rank matched one process."""
    ref, tolerance = reference(cp, case, dtype), TOLERANCES[dtype]
    layout = "zigzag" if case == "zigzag" else "ring"
    ats = [torch.tensor(positions_of(r, cp, layout, length(cp))) for r in range(cp)]
    outs = [r["out"] for r in per_rank]
    if not all(_close(o, ref["out"][:, :, at], tolerance) for o, at in zip(outs, ats)):
        if any(o.shape != ref["out"][:, :, at].shape for o, at in zip(outs, ats)):
            return (f"the output has shape {tuple(outs[0].shape)} on rank 0, where its queries' attention is "
                    f"{tuple(ref['out'][:, :, ats[0]].shape)}")
        for name, wrong in ref["wrong"].items():
            if all(_close(o, wrong[:, :, at], tolerance) for o, at in zip(outs, ats)):
                return CAUSES[name]
        got, want = torch.cat(outs, dim=2), torch.cat([ref["out"][:, :, at] for at in ats], dim=2)
        if torch.allclose(got.double().flatten().sort().values, want.flatten().sort().values, atol=tolerance, rtol=0):
            return ("the right values in the wrong places (a scrambled exchange: an all-to-all's output laid out "
                    "unlike its input, e.g. made with empty_like of a permuted tensor)")
        worst = max((o - ref["out"][:, :, at]).abs().max().item() for o, at in zip(outs, ats))
        return f"the output differs from one process's by up to {worst:.3g}"
    names = ("dq", "dk", "dv")
    for i, name in enumerate(names):
        grads = [r["grads"][i] for r in per_rank]
        if any(g is None for g in grads):
            return f"{name} is None: the output is not differentiable back to {name[1]}"
    wrong = [n for i, n in enumerate(names)
             if not all(_close(r["grads"][i], ref["grads"][i][:, :, at], tolerance) for r, at in zip(per_rank, ats))]
    if not wrong:
        return None
    if wrong == ["dk", "dv"] or set(wrong) <= {"dk", "dv"}:
        kept = [own_queries_grads(ref, r, cp, case) for r in range(cp)]
        if all(_close(per_rank[r]["grads"][1], kept[r][0], tolerance)
               and _close(per_rank[r]["grads"][2], kept[r][1], tolerance) for r in range(cp)):
            return ("dK/dV not returned to their owners: each rank kept only what its own queries gave its keys "
                    "(the other ranks' contributions must travel back, around the ring or by a reduce-scatter)")
    worst = {n: max((r["grads"][i] - ref["grads"][i][:, :, at]).abs().max().item() for r, at in zip(per_rank, ats))
             for i, n in enumerate(names) if n in wrong}
    return "the output is right, the gradients are not: " + ", ".join(f"{n} by up to {e:.3g}" for n, e in worst.items())


def seen_line(per_rank: list[dict], cp: int, case: str) -> str:
    """Bytes each rank sent beside the ring's formula; each rank's time, max over mean, beside the causal formula."""
    tokens = BATCH * length(cp) // cp
    ring = exchange_bytes("ring", cp, 2, tokens, HEADS * HEAD_DIM, HEADS * HEAD_DIM, 8)
    sent = [r["sent"] for r in per_rank]
    times = [r["seconds"] for r in per_rank]
    layout = "zigzag" if case == "zigzag" else "ring"
    formula = 1.0 if case == "full" else imbalance(cp, layout, 2, length(cp))
    return (f"sent {', '.join(f'{s / 1024:.0f}' for s in sent)} KiB by rank, handed to sends and collectives (a "
            f"ring's K/V forward and backward with its dK/dV: {(ring['forward'] + ring['backward']) / 1024:.0f} KiB); "
            "time max/mean "
            f"{max(times) * len(times) / sum(times):.2f} (the causal work's formula, {layout} split: {formula:.2f})")


def waiting(progress: str, case: str, cp: int) -> str:
    """What each rank was in when its ranks were stopped, and the cause where it is plain: every rank receiving
    (none sends), or ranks in different collectives."""
    told, calls = [], {}
    for rank in range(cp):
        path = Path(progress, f"rank{rank}.{case}.cp")
        text = path.read_bytes().decode(errors="replace").strip() if path.exists() else ""
        if not text:
            told.append(f"rank {rank} is in no watched call (computing, or waiting elsewhere)")
            continue
        call = calls[rank] = json.loads(text)
        op, peer = call["op"], call.get("peer")
        if op in ("recv", "irecv"):
            told.append(f"rank {rank} waits to receive from rank {peer}")
        elif op in ("send", "isend"):
            told.append(f"rank {rank} waits to send to rank {peer}")
        else:
            told.append(f"rank {rank} waits in {op}")
    cause = []
    if len(calls) == cp and all(c["op"] in ("recv", "irecv") for c in calls.values()):
        cause.append("every rank waits to receive and none sends (post the send first, or both together: "
                     "batch_isend_irecv)")
    elif len({c["op"] for c in calls.values() if c["op"] not in ("send", "isend", "recv", "irecv")}) > 1:
        cause.append("the ranks wait in different collectives (called in a different order on different ranks)")
    return "; ".join(cause + told)


def check_attention(target: str, degrees: list[int], names: list[str], timeout_s: float, log_dir: str,
                    dtype: str = "float64") -> list[tuple]:
    """The context-parallel check of an attention function: (cp, case, verdict, detail, a crashed rank's traceback
    or None) per case and degree, and a `seen` line per finished case; each case in a set of ranks of its own."""
    fn = locate_attention(target)
    lines = []
    for cp in degrees:
        for name in names:
            if name == "zigzag" and not takes_layout(fn):
                lines.append((cp, name, "skip", "not applicable: the function takes no `layout` keyword (add one to "
                              "be checked on the zigzag split)", None))
                continue
            with tempfile.TemporaryDirectory() as progress:
                try:
                    per_rank = run_ranks(run_cp_case, cp, target, name, progress, dtype, timeout_s=timeout_s,
                                         log_dir=log_dir)
                except Exception as exc:  # a rank raised, died or hung
                    failure, trace = ended_by(exc, timeout_s)
                    if isinstance(exc, RanksFailed) and exc.timed_out:
                        failure = f"still running after {timeout_s:g} s: {waiting(progress, name, cp)}"
                    lines.append((cp, name, "FAIL", f"{CP_CASES[name]}: FAILED: {failure}", trace))
                    continue
            cause = cp_verdict(per_rank, cp, name, dtype)
            lines.append((cp, name, "FAIL" if cause else "ok",
                          f"{CP_CASES[name]}: FAILED: {cause}" if cause else CP_CASES[name], None))
            lines.append((cp, name, "seen", seen_line(per_rank, cp, name), None))
    return lines


def header(target: str, dtype: str = "float64") -> str:
    return (f"{target} (a context-parallel attention, each rank its tokens) against one process's "
            f"scaled_dot_product_attention over the whole sequence ({dtype}, within {TOLERANCES[dtype]:g}; torch "
            f"{torch.__version__}, gloo on CPU; {BATCH} sequences, {HEADS} heads of {HEAD_DIM}, 2 x cp chunks of "
            f"{CHUNK} tokens):")
