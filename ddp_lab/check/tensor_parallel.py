"""`python -m ddp_lab.check my_pkg.ColumnParallelLinear,my_pkg.RowParallelLinear --tp 2,4`: does a pair of
tensor-parallel layers train like one process?

The layers keep Megatron's contract, as the lecture writes them (docs/check_tp.md):

- `Column(linear)` and `Row(linear)` are built on every TP rank from the same whole `nn.Linear` (a `group=`,
  `process_group=` or `tp_group=` argument gets the TP group where the constructor takes one; otherwise the
  default group is the TP group) and keep this rank's piece as parameters named `weight` and `bias`, in
  `nn.Linear`'s layout: a column-parallel layer its rows of the weight (the output features) and of the bias,
  a row-parallel layer its columns of the weight (the input features) and the whole bias;
- forward: a column-parallel layer takes the whole input and returns its slice of the output features; a
  row-parallel layer takes that slice and returns the whole output, summed over the TP ranks, the bias added
  once; backward: whatever makes the gradients those of one process (the column layer's input gradient
  all-reduced, the row layer's output gradient passed as it is).

Each case builds one of the check's models with the user's layers where Megatron puts them (the feed-forward
block's first linear column-wise and its second row-wise; attention's q, k and v column-wise, heads split, and
its output row-wise), from the same seed on every rank, and trains 3 SGD steps on the same batch on every TP
rank (under sequence parallelism, a case of its own for layers that take `sequence_parallel`, each rank its
tokens of it) against the single-process model on it: the pieces must put back together into the whole layer (in the
order of the ranks), and the output, the input's gradient, every piece's gradient and the weights after the
steps must equal one process's, to float32 rounding. A FAIL names the first thing that differs and the cause
it points to (`_cause`).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddp_lab.check.cases import locate_class
from ddp_lab.check.ranks import run_ranks
from ddp_lab.check.verdict import ended_by

D_MODEL, HEADS, HIDDEN, SEQUENCE, BATCH = 16, 4, 32, 8, 4  # SEQUENCE: split by tp 2 and 4
STEPS, LR, SEED = 3, 0.1, 1234
ATOL, RTOL = 1e-5, 1e-4
GROUP_ARGUMENTS = ("group", "process_group", "tp_group")


class FeedForward(nn.Module):
    """Megatron's MLP: `w1` column-parallel, `w2` row-parallel, no collective between them."""

    parallel = {"w1": "column", "w2": "row"}

    def __init__(self, hidden: int = HIDDEN, bias: bool = True):
        super().__init__()
        self.w1, self.w2 = nn.Linear(D_MODEL, hidden, bias=bias), nn.Linear(hidden, D_MODEL, bias=bias)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Attention(nn.Module):
    """Causal self-attention: `q`, `k`, `v` column-parallel (each rank computes its heads), `out` row-parallel."""

    parallel = {"q": "column", "k": "column", "v": "column", "out": "row"}

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D_MODEL, D_MODEL) for _ in range(3))
        self.out = nn.Linear(D_MODEL, D_MODEL)
        self.head_dim = D_MODEL // HEADS

    def forward(self, x):
        batch, length, _ = x.shape
        q, k, v = (f(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # the heads this rank holds
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))


def _frozen_feed_forward():
    model = FeedForward()
    model.w1.requires_grad_(False)
    return model


@dataclass(frozen=True)
class TPCase:
    name: str
    build: object
    proves: str
    sequence_parallel: bool = False  # built with sequence_parallel=True, each rank given its tokens


TP_CASES = {case.name: case for case in (
    TPCase("mlp", FeedForward, "the feed-forward block (w1 column-parallel, w2 row-parallel, with biases) computes, "
           "backpropagates and steps as one process"),
    TPCase("attention", Attention, "attention with its heads split (q, k, v column-parallel, out row-parallel)"),
    TPCase("frozen", _frozen_feed_forward, "a frozen column-parallel layer: its piece never moves"),
    TPCase("uneven", lambda: FeedForward(hidden=HIDDEN + 1), f"a hidden size ({HIDDEN + 1}) no TP degree divides: "
           "right, or refused when built (skip)"),
    TPCase("sequence_parallel", FeedForward, "sequence parallelism, where both layers take sequence_parallel: each "
           "rank given its tokens, the column layer gathers them and the row layer scatters its sum over them, the "
           "row's bias gradient summed over the ranks", sequence_parallel=True),
)}


def claims_sequence_parallel(cls: type) -> bool:
    return "sequence_parallel" in inspect.signature(cls).parameters


def pair(target: str) -> tuple[str, str]:
    """`my_pkg.Column,my_pkg.Row` -> both paths; ValueError naming what is wrong."""
    parts = [p for p in target.split(",") if p]
    if len(parts) != 2:
        raise ValueError(f"{target!r}: a tensor-parallel check takes two classes, the column-parallel then the "
                         "row-parallel layer (my_pkg.ColumnParallelLinear,my_pkg.RowParallelLinear)")
    for path in parts:
        cls = locate_class(path)
        if not issubclass(cls, nn.Module):
            raise ValueError(f"{path} is not a torch.nn.Module class")
    return parts[0], parts[1]


def _build(cls: type, linear: nn.Linear, sequence_parallel: bool) -> nn.Module:
    parameters = inspect.signature(cls).parameters
    group = next((name for name in GROUP_ARGUMENTS if name in parameters), None)
    return cls(linear, **({group: dist.group.WORLD} if group else {}),
               **({"sequence_parallel": True} if sequence_parallel else {}))


def parallelize(model: nn.Module, column: type, row: type, sequence_parallel: bool = False) -> dict[str, nn.Module]:
    """Replace each linear `model.parallel` names by the user's layer built from it; the new layers by name."""
    out = {}
    for name, kind in model.parallel.items():
        out[name] = _build(column if kind == "column" else row, getattr(model, name), sequence_parallel)
        setattr(model, name, out[name])
    return out


def run_tp_cases(rank: int, world_size: int, column_path: str, row_path: str, names: list[str]) -> dict:
    """On every TP rank, per case: what differs from one process, read on this rank (`_compare`), or the
    exception the user's layers raised when built (the uneven case may refuse)."""
    column, row = locate_class(column_path), locate_class(row_path)
    out = {}
    for name in names:
        case = TP_CASES[name]
        if case.sequence_parallel and not (claims_sequence_parallel(column) and claims_sequence_parallel(row)):
            out[name] = {"unclaimed": "the layers take no sequence_parallel argument: none claimed"}
            continue
        torch.manual_seed(SEED)  # the same whole model on every rank: the layers are built from it
        reference = case.build()
        model = copy.deepcopy(reference)
        try:
            layers = parallelize(model, column, row, case.sequence_parallel)
        except Exception as exc:  # noqa: BLE001 - a refusal of the user's, reported as the case's
            if name != "uneven":
                raise
            out[name] = {"refused": f"{type(exc).__name__}: {exc}"}
            continue
        out[name] = _compare(reference, model, layers, rank, world_size, case.sequence_parallel)
    return out


def _pieces(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in layer.named_parameters(recurse=False) if n in ("weight", "bias")}


def _gathered(tensor: torch.Tensor | None, world_size: int) -> list:
    parts = [None] * world_size
    dist.all_gather_object(parts, None if tensor is None else tensor.detach().clone())
    return parts


def _split_of(kind: str, name: str) -> int | None:
    """The dimension a piece is cut along (None: whole on every rank)."""
    if kind == "column":
        return 0
    return 1 if name == "weight" else None


def _offsets(layers: dict, model: nn.Module, reference: nn.Module, world_size: int, rank: int
             ) -> tuple[dict, str | None]:
    """Each piece's slice of its whole parameter on this rank, learned from every rank's piece: {(layer,
    parameter): (dim, start, length)}; and a cause where the pieces do not put back together into the whole."""
    out = {}
    for layer_name, layer in layers.items():
        kind = model.parallel[layer_name]
        for name, piece in _pieces(layer).items():
            whole = getattr(getattr(reference, layer_name), name).detach()
            dim = _split_of(kind, name)
            parts = _gathered(piece, world_size)
            if dim is None:
                if not all(torch.equal(p, whole) for p in parts):
                    return out, (f"the {kind}-parallel {layer_name}.{name} is not the whole {name} on every rank (a "
                                 "row-parallel layer keeps the bias whole: it is added once, after the sum)")
                out[(layer_name, name)] = None
                continue
            if _fits(parts, whole, dim):
                start = sum(p.shape[dim] for p in parts[:rank])
                out[(layer_name, name)] = (dim, start, piece.shape[dim])
                continue
            other = 1 - dim if whole.ndim == 2 else None
            along = ("rows (the output features)" if dim == 0 else "columns (the input features)")
            if other is not None and _fits(parts, whole, other):
                return out, (f"a shard is taken along the wrong dimension: the {kind}-parallel {layer_name}.{name} "
                             f"holds {'columns' if other == 1 else 'rows'} of the whole weight where its {along} "
                             "belong (nn.Linear's weight is (out_features, in_features))")
            shapes = ", ".join(str(tuple(p.shape)) for p in parts)
            return out, (f"the {kind}-parallel {layer_name}.{name}'s pieces ({shapes}) do not put back together "
                         f"into the whole {tuple(whole.shape)} along its {along}")
    return out, None


def _fits(parts: list, whole: torch.Tensor, dim: int) -> bool:
    if any(p is None or p.ndim != whole.ndim for p in parts):
        return False
    try:
        return torch.equal(torch.cat(parts, dim=dim), whole)
    except RuntimeError:
        return False


def _none_or(t):
    return None if t is None else t.detach().clone()


def _whole(reference: nn.Module, layer: str, name: str) -> torch.Tensor:
    return getattr(getattr(reference, layer), name).detach()


def _slice(tensor: torch.Tensor, where) -> torch.Tensor:
    return tensor if where is None else tensor.narrow(where[0], where[1], where[2])


def _differs(got: torch.Tensor | None, expected: torch.Tensor | None) -> float | None:
    """The largest difference where `got` is not `expected` to float32 rounding, else None."""
    if got is None or expected is None:
        return None if got is expected else float("inf")
    if got.shape != expected.shape:
        return float("inf")
    if torch.allclose(got, expected, atol=ATOL, rtol=RTOL):
        return None
    return (got - expected).abs().max().item()


def _compare(reference: nn.Module, model: nn.Module, layers: dict, rank: int, world_size: int,
             sequence_parallel: bool = False) -> dict:
    """Train both on the same batch; what differs on this rank, first step's forward and backward, then weights.
    Under sequence parallelism the layers see this rank's tokens (and give its tokens' output), and its share of the
    loss is its tokens' part of the whole batch's mean: the ranks' losses sum to one process's."""
    where, cause = _offsets(layers, model, reference, world_size, rank)
    if cause is not None:
        return {"pieces": cause}
    found: dict = {"pieces": None, "rank": rank}
    generator = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(BATCH, SEQUENCE, D_MODEL, generator=generator)
    target = torch.randn(BATCH, SEQUENCE, D_MODEL, generator=generator)
    mine = (lambda t: t.tensor_split(world_size, dim=1)[rank]) if sequence_parallel else (lambda t: t)
    optimizers = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=LR) for m in (reference, model)]
    for step in range(STEPS):
        outputs, inputs = [], []
        for m in (reference, model):
            given = (x if m is reference else mine(x)).clone().requires_grad_(True)
            y = m(given)
            part = target if m is reference else mine(target)
            (F.mse_loss(y, part, reduction="sum") / target.numel()).backward()
            outputs.append(mine(y.detach()) if m is reference else y.detach())  # this rank's tokens' on both sides
            inputs.append(mine(given.grad) if m is reference else given.grad)
        if step == 0:
            found["output"] = _differs(outputs[1], outputs[0])
            found["output_off_by"] = (outputs[1] - outputs[0]).detach()
            found["input_grad"] = _differs(inputs[1], inputs[0])
            found["grads"] = {f"{layer}.{name}": _differs(p.grad, _slice(getattr(getattr(reference, layer), name).grad,
                                                                             where[(layer, name)]))
                              for layer, piece in layers.items() for name, p in _pieces(piece).items()
                              if getattr(getattr(reference, layer), name).requires_grad}
            rows = [layer for layer, kind in model.parallel.items() if kind == "row"
                    and getattr(reference, layer).bias is not None]
            found["row_biases"] = {layer: getattr(reference, layer).bias.detach().clone() for layer in rows}
            found["row_bias_grads"] = {layer: (_none_or(layers[layer].bias.grad),
                                               getattr(reference, layer).bias.grad.clone()) for layer in rows}
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    found["weights"] = {f"{layer}.{name}": _differs(p.detach(),
                                                    _slice(_whole(reference, layer, name), where[(layer, name)]))
                        for layer, piece in layers.items() for name, p in _pieces(piece).items()}
    found["frozen_moved"] = [f"{layer}.{name}" for layer, piece in layers.items() for name, p in _pieces(piece).items()
                             if not getattr(getattr(reference, layer), name).requires_grad
                             and found["weights"][f"{layer}.{name}"] is not None]
    return found


def tp_verdict(per_rank: list[dict], world_size: int) -> tuple[str, str | None]:
    """("ok" / "skip" / "FAIL", the line's detail or None) from every rank's findings of one case."""
    first = per_rank[0]
    if "refused" in first:
        return "skip", f"refused when built at tp {world_size}: {first['refused']}"
    if "unclaimed" in first:
        return "skip", first["unclaimed"]
    cause = _cause(per_rank, world_size)
    return ("FAIL", cause) if cause else ("ok", None)


def _worst(per_rank: list[dict], key: str) -> tuple[int, float] | None:
    found = [(r["rank"], r[key]) for r in per_rank if r.get(key) is not None]
    return max(found, key=lambda f: f[1]) if found else None


def _cause(per_rank: list[dict], world_size: int) -> str | None:
    """The first thing that differs from one process, and what it points to."""
    pieces = next((r["pieces"] for r in per_rank if r["pieces"]), None)
    if pieces:
        return pieces
    frozen = sorted({n for r in per_rank for n in r["frozen_moved"]})
    if frozen:
        return f"a frozen parameter moved ({', '.join(frozen)}): its piece must keep requires_grad=False"
    output = _worst(per_rank, "output")
    if output:
        rank, diff = output
        off = per_rank[rank]["output_off_by"]
        for layer, bias in per_rank[rank]["row_biases"].items():
            if torch.allclose(off, (world_size - 1) * bias.expand_as(off), atol=ATOL * 10, rtol=RTOL * 10):
                return (f"a row-parallel layer adds its bias on every rank ({layer}: the output is off by "
                        f"{world_size - 1} x its bias; add it once, after the sum)")
        apart = any(not torch.allclose(r["output_off_by"], per_rank[0]["output_off_by"], atol=ATOL)
                    for r in per_rank[1:])
        summed = (" and the ranks' outputs differ: the row-parallel layer's partial outputs are not summed over the "
                  "TP ranks (an all-reduce in its forward)?") if apart else ""
        return f"the forward differs from one process (rank {rank}: max |difference| {diff:.3g}){summed}"
    grads = {name: (r["rank"], d) for r in per_rank for name, d in r["grads"].items() if d is not None}
    input_grad = _worst(per_rank, "input_grad")
    if input_grad and not grads:
        rank, diff = input_grad
        return ("the backward of a column-parallel layer does not all-reduce the input gradient (the output and "
                f"every piece's gradient are right, the input's is not: rank {rank}, max |difference| {diff:.3g}; "
                "each rank holds only its part of it; under sequence parallelism, reduce-scatter it)")
    summed = _bias_gradient_not_summed(per_rank, grads)
    if summed:
        return summed
    if grads:
        name, (rank, diff) = next(iter(grads.items()))
        listed = ", ".join(sorted(grads))
        return (f"a piece's gradient differs ({listed}; rank {rank}, {name}: max |difference| {diff:.3g}) while the "
                "forward is right: a backward that sums what is already whole (an all-reduce in the row-parallel "
                "layer's backward, counted tp times?) or drops a part")
    if input_grad:
        rank, diff = input_grad
        return f"the input's gradient differs (rank {rank}: max |difference| {diff:.3g})"
    weights = {name: (r["rank"], d) for r in per_rank for name, d in r["weights"].items() if d is not None}
    if weights:
        name, (rank, diff) = next(iter(weights.items()))
        return (f"the weights after {STEPS} SGD steps differ ({', '.join(sorted(weights))}; rank {rank}, {name}: "
                f"max |difference| {diff:.3g}) although the first step's gradients were right")
    return None


def _bias_gradient_not_summed(per_rank: list[dict], grads: dict) -> str | None:
    """Under sequence parallelism a row-parallel bias is added to each rank's tokens only: where the only wrong
    gradients are such biases' and their sum over the ranks is one process's, the sum over the ranks is missing."""
    wrong = {name.rpartition(".")[0] for name in grads}
    if not wrong or any(not name.endswith(".bias") for name in grads):
        return None
    for layer in wrong:
        parts = [r["row_bias_grads"].get(layer) for r in per_rank]
        if any(p is None or p[0] is None for p in parts):
            return None
        if not torch.allclose(sum(p[0] for p in parts), parts[0][1], atol=ATOL, rtol=RTOL):
            return None
    return (f"under sequence parallelism a row-parallel layer's bias gradient is only its own tokens' "
            f"({', '.join(sorted(wrong))}.bias: the ranks' gradients sum to one process's; sum it over the TP ranks)")


def check_pair(target: str, degrees: list[int], names: list[str], timeout_s: float, log_dir: str) -> list[tuple]:
    """The tensor-parallel check of a `COLUMN,ROW` pair, run from the command line: (tp, case, verdict, detail,
    a crashed rank's traceback or None) per case and degree, each case in a set of ranks of its own (a hang or a
    crash costs that case only)."""
    column, row = pair(target)
    lines = []
    for tp in degrees:
        for name in names:
            try:
                per_rank = run_ranks(run_tp_cases, tp, column, row, [name], timeout_s=timeout_s, log_dir=log_dir)
            except Exception as exc:  # a rank raised, died or hung
                failure, trace = ended_by(exc, timeout_s)
                lines.append((tp, name, "FAIL", f"{TP_CASES[name].proves}: FAILED: {failure}", trace))
                continue
            verdict_, detail = tp_verdict([r[name] for r in per_rank], tp)
            shown = TP_CASES[name].proves if verdict_ == "ok" else \
                detail if verdict_ == "skip" else f"{TP_CASES[name].proves}: FAILED: {detail}"
            lines.append((tp, name, verdict_, shown, None))
    return lines


def header(target: str) -> str:
    """What a pair is checked against, the first line of the check's output."""
    return (f"{target} (column-parallel, row-parallel) against single-process training (atol {ATOL:g}, rtol "
            f"{RTOL:g}; torch {torch.__version__}, gloo on CPU; {STEPS} SGD steps, every TP rank on the same batch):")
