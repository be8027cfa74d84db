"""`python -m ddp_lab.check my_pkg.ColumnParallelLinear,my_pkg.RowParallelLinear --tp 2,4`: does a pair of
tensor-parallel layers train like one process?

The layers keep Megatron's contract, as the lecture writes them (docs/check_tp.md):

- `Column(linear)` and `Row(linear)` are built on every TP rank from the same whole `nn.Linear`, or, as frameworks
  build them, from its sizes (`Column(in_features, out_features, bias=..., group=...)`, IN_SIZES and OUT_SIZES
  naming the keywords taken), drawing their own weights, from which the reference is put together (`assemble`); a
  `group=`, `process_group=` or `tp_group=` argument gets the TP group where the constructor takes one (otherwise
  the default group is the TP group); each keeps this rank's piece as parameters named `weight` and `bias`, in
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
tokens of it; inputs of 2 dimensions in one; in the mesh case, 2 x tp ranks, each TP group of consecutive ranks
given as the layers' group) against the single-process model on it: the pieces must put back together into the
whole layer (in the order of the ranks), and the output, the input's gradient, every piece's gradient and the
weights after the steps must equal one process's, to float32 rounding. A FAIL names the first thing that differs
and the cause it points to (`_cause`; on the mesh, a cause in a later TP group only is the global rank's).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddp_lab.check.built import refuses_sizes, unset_memory_as_nan, unset_weights
from ddp_lab.check.cases import locate_class
from ddp_lab.check.ranks import run_ranks
from ddp_lab.check.verdict import ended_by, worst

D_MODEL, HEADS, HIDDEN, SEQUENCE, BATCH = 16, 4, 32, 8, 4  # SEQUENCE: split by tp 2 and 4
STEPS, LR, SEED = 3, 0.1, 1234
ATOL, RTOL = 1e-5, 1e-4
GROUP_ARGUMENTS = ("group", "process_group", "tp_group")
IN_SIZES = ("in_features", "input_size", "in_dim", "input_dim", "in_size", "d_in")
OUT_SIZES = ("out_features", "output_size", "out_dim", "output_dim", "out_size", "d_out")
MESH_DP = 2  # the mesh case: dp x tp ranks, run at tp 2 (4 ranks as 2 x 2)


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
    flat: bool = False  # inputs of 2 dimensions (tokens, features) instead of 3 (batch, sequence, features)
    dp: int = 1  # data-parallel replicas of the TP group: dp x tp ranks, each TP group its own consecutive ranks


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
    TPCase("inputs_2d", FeedForward, "the feed-forward block on inputs of 2 dimensions (tokens, features), as a "
           "flattened batch reaches it", flat=True),
    TPCase("mesh", FeedForward, f"the feed-forward block on a {MESH_DP} x tp mesh of data and tensor parallelism: "
           "each TP group of consecutive ranks, given to the layers as their group, trains as one process (a layer "
           "that reads the global rank where its group's belongs takes pieces that are not its own)", dp=MESH_DP),
)}
MESH_TP = 2
"""The TP degree the mesh case runs at (4 ranks as 2 x 2); at other degrees it is a skip that says so."""


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


def takes_2d_inputs(cls: type) -> bool:
    """A layer opts out of the inputs_2d case with a class attribute `takes_2d_inputs = False` (one documented for
    (batch, sequence, features) inputs only)."""
    return getattr(cls, "takes_2d_inputs", True) is not False


def group_argument(cls: type) -> str | None:
    """The keyword a layer takes its TP group by (GROUP_ARGUMENTS), or None: it uses every rank."""
    parameters = inspect.signature(cls).parameters
    return next((name for name in GROUP_ARGUMENTS if name in parameters), None)


def size_arguments(cls: type) -> tuple[str, str] | None:
    """(input size keyword, output size keyword) of a layer built from sizes (IN_SIZES, OUT_SIZES: the names of the
    common frameworks), or None: it is built from a whole nn.Linear."""
    parameters = inspect.signature(cls).parameters
    given_in = next((name for name in IN_SIZES if name in parameters), None)
    given_out = next((name for name in OUT_SIZES if name in parameters), None)
    return (given_in, given_out) if given_in and given_out else None


def _build(cls: type, linear: nn.Linear, sequence_parallel: bool, group) -> nn.Module:
    """The user's layer in place of `linear`: built from it, or from its sizes (drawing its own weights, their
    trainability copied from `linear`'s); the TP group given where the constructor takes one."""
    given = group_argument(cls)
    extra = {**({given: group} if given else {}), **({"sequence_parallel": True} if sequence_parallel else {})}
    sizes = size_arguments(cls)
    if sizes is None:
        return cls(linear, **extra)
    layer = cls(**{sizes[0]: linear.in_features, sizes[1]: linear.out_features}, bias=linear.bias is not None, **extra)
    for name, piece in _pieces(layer).items():
        piece.requires_grad_(getattr(linear, name).requires_grad)
    return layer


def parallelize(model: nn.Module, column: type, row: type, sequence_parallel: bool = False,
                group=None) -> dict[str, nn.Module]:
    """Replace each linear `model.parallel` names by the user's layer built from it; the new layers by name."""
    out = {}
    for name, kind in model.parallel.items():
        out[name] = _build(column if kind == "column" else row, getattr(model, name), sequence_parallel,
                           dist.group.WORLD if group is None else group)
        setattr(model, name, out[name])
    return out


def nonzero_biases(layers: dict, kinds: dict, group) -> None:
    """Biases a constructor sets to zero (Megatron's and most frameworks' do) given nonzero values, drawn from one seed
    (a column layer's piece its rows of one whole bias, in group-rank order; a row layer's bias whole and the same on
    every rank), before the reference is put together: a zero bias added on every rank adds nothing, and that bug
    would show only as a drift after the steps instead of at the first forward."""
    for name, layer in layers.items():
        bias = _pieces(layer).get("bias")
        parts = _gathered(bias, group)
        if bias is None or any(p is None or p.count_nonzero() for p in parts):
            continue
        whole = torch.randn(sum(p.numel() for p in parts) if kinds[name] == "column" else bias.numel(),
                            generator=torch.Generator().manual_seed(SEED + 2)) * 0.1
        start = sum(p.numel() for p in parts[:dist.get_rank(group)]) if kinds[name] == "column" else 0
        with torch.no_grad():
            bias.copy_(whole[start:start + bias.numel()])


def assemble(reference: nn.Module, layers: dict, kinds: dict, group) -> None:
    """The reference's whole linears put together from the pieces layers built from sizes drew (column: rows in group
    rank order; row: columns, and the first rank's bias); a piece that does not fit is left for `_offsets` to name."""
    for name, layer in layers.items():
        whole = getattr(reference, name)
        for key, piece in _pieces(layer).items():
            parts = _gathered(piece, group)
            dim = _split_of(kinds[name], key)
            try:
                value = parts[0] if dim is None else torch.cat(parts, dim=dim)
            except RuntimeError:
                continue
            if value.shape == getattr(whole, key).shape:
                with torch.no_grad():
                    getattr(whole, key).copy_(value)


def tp_groups(world_size: int, dp: int):
    """This rank's TP group: every rank (dp 1), or on a dp x tp mesh the group of its `world_size // dp` consecutive
    ranks (every rank makes every group, in one order, as torch asks)."""
    if dp == 1:
        return dist.group.WORLD
    tp = world_size // dp
    groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(dp)]
    return groups[dist.get_rank() // tp]


def run_tp_cases(rank: int, world_size: int, column_path: str, row_path: str, names: list[str]) -> dict:
    """On every rank, per case: what differs from one process, read on this rank (`_compare`), or the exception the
    user's layers raised when built (the uneven case may refuse; on the mesh, what one rank raised is its finding)."""
    column, row = locate_class(column_path), locate_class(row_path)
    out = {}
    for name in names:
        case = TP_CASES[name]
        if case.sequence_parallel and not (claims_sequence_parallel(column) and claims_sequence_parallel(row)):
            out[name] = {"unclaimed": "the layers take no sequence_parallel argument: none claimed"}
            continue
        if case.flat and not (takes_2d_inputs(column) and takes_2d_inputs(row)):
            out[name] = {"unclaimed": "the layers say they take inputs of 3 dimensions only (takes_2d_inputs = "
                                      "False)"}
            continue
        if case.dp > 1 and not (group_argument(column) and group_argument(row)):
            out[name] = {"unclaimed": "the layers take no group (group, process_group or tp_group): on a mesh they "
                                      "cannot be told which ranks are their TP group"}
            continue
        group = tp_groups(world_size, case.dp)
        torch.manual_seed(SEED)  # the same whole model on every rank: the layers are built from it
        reference = case.build()
        model = copy.deepcopy(reference)
        try:
            with unset_memory_as_nan():
                layers = parallelize(model, column, row, case.sequence_parallel, group)
        except Exception as exc:  # noqa: BLE001 - a refusal of the user's, reported as the case's
            if name != "uneven" and case.dp == 1:
                raise
            said = f"{type(exc).__name__}: {exc}"
            refused = name == "uneven" and refuses_sizes(exc)
            if name == "uneven" and not refused:
                said += (" (no refusal: a layer refuses sizes it cannot split with a ValueError or AssertionError of "
                         "its own)")
            out[name] = {"refused" if refused else "raised": said, "global_rank": rank}
            continue
        unset = unset_weights(layers)
        if unset is not None:
            out[name] = {"unset": unset, "global_rank": rank}
            continue
        if any(size_arguments(type(layer)) for layer in layers.values()):
            nonzero_biases(layers, model.parallel, group)
            assemble(reference, layers, model.parallel, group)
        out[name] = {**_compare(reference, model, layers, dist.get_rank(group), dist.get_world_size(group),
                                case.sequence_parallel, group, case.flat), "global_rank": rank}
    return out


def _pieces(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in layer.named_parameters(recurse=False) if n in ("weight", "bias")}


def _gathered(tensor: torch.Tensor | None, group) -> list:
    """Every rank of `group`'s `tensor`, in its group-rank order."""
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, None if tensor is None else tensor.detach().clone(), group=group)
    return parts


def _split_of(kind: str, name: str) -> int | None:
    """The dimension a piece is cut along (None: whole on every rank)."""
    if kind == "column":
        return 0
    return 1 if name == "weight" else None


def _offsets(layers: dict, model: nn.Module, reference: nn.Module, rank: int, group) -> tuple[dict, str | None]:
    """Each piece's slice of its whole parameter on this rank, learned from every rank's piece: {(layer,
    parameter): (dim, start, length)}; and a cause where the pieces do not put back together into the whole."""
    out = {}
    for layer_name, layer in layers.items():
        kind = model.parallel[layer_name]
        for name, piece in _pieces(layer).items():
            whole = getattr(getattr(reference, layer_name), name).detach()
            dim = _split_of(kind, name)
            parts = _gathered(piece, group)
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
             sequence_parallel: bool = False, group=None, flat: bool = False) -> dict:
    """Train both on the same batch; what differs on this rank, first step's forward and backward, then weights.
    Under sequence parallelism the layers see this rank's tokens (and give its tokens' output), and its share of the
    loss is its tokens' part of the whole batch's mean: the ranks' losses sum to one process's."""
    where, cause = _offsets(layers, model, reference, rank, dist.group.WORLD if group is None else group)
    if cause is not None:
        return {"pieces": cause, "rank": rank}
    found: dict = {"pieces": None, "rank": rank}
    generator = torch.Generator().manual_seed(SEED + 1)
    shape = (BATCH * SEQUENCE, D_MODEL) if flat else (BATCH, SEQUENCE, D_MODEL)
    x = torch.randn(*shape, generator=generator)
    target = torch.randn(*shape, generator=generator)
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


def tp_verdict(per_rank: list[dict], tp: int) -> tuple[str, str | None]:
    """("ok" / "skip" / "FAIL", the line's detail or None) from every rank's findings of one case (on a mesh, every
    TP group's: `per_rank` in global rank order, each group `tp` consecutive ranks)."""
    first = per_rank[0]
    unset = next((r["unset"] for r in per_rank if "unset" in r), None)
    if unset is not None:
        return "FAIL", unset
    if "refused" in first:
        return "skip", f"refused when built at tp {tp}: {first['refused']}"
    if "unclaimed" in first:
        return "skip", first["unclaimed"]
    groups = [per_rank[g:g + tp] for g in range(0, len(per_rank), tp)]
    causes = [_group_cause(group, tp) for group in groups]
    if len(groups) > 1 and causes[0] is None and any(causes[1:]):
        late = next(g for g, c in enumerate(causes) if c)
        ranks = f"{late * tp}-{late * tp + tp - 1}"
        return "FAIL", (f"the layers read the global rank (dist.get_rank()) where their TP group's rank belongs "
                        f"(dist.get_rank(group)): the first TP group (ranks 0-{tp - 1}) trains as one process, the "
                        f"group of ranks {ranks} does not: {causes[late]}")
    cause = next((c for c in causes if c), None)
    return ("FAIL", cause) if cause else ("ok", None)


def _group_cause(per_rank: list[dict], tp: int) -> str | None:
    """One TP group's cause: what one of its ranks raised when built, or `_cause` of its findings."""
    raised = next((r for r in per_rank if "raised" in r), None)
    if raised is not None:
        return f"rank {raised['global_rank']} raised when its layers were built: {raised['raised']}"
    return _cause(per_rank, tp)


def _cause(per_rank: list[dict], world_size: int) -> str | None:
    """The first thing that differs from one process, and what it points to."""
    pieces = next((r["pieces"] for r in per_rank if r["pieces"]), None)
    if pieces:
        return pieces
    frozen = sorted({n for r in per_rank for n in r["frozen_moved"]})
    if frozen:
        return f"a frozen parameter moved ({', '.join(frozen)}): its piece must keep requires_grad=False"
    output = worst(per_rank, "output")
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
    input_grad = worst(per_rank, "input_grad")
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
    lines, unset = [], None
    for tp in degrees:
        for name in names:
            dp = TP_CASES[name].dp
            if unset is not None:  # said once, in the FAIL line above
                lines.append((tp, name, "skip", "not run: the layers' weights are not finite after they are built "
                                                "(the FAIL above)", None))
                continue
            if dp > 1 and tp != MESH_TP:
                lines.append((tp, name, "skip", f"the mesh case runs at tp {MESH_TP} ({dp} x {MESH_TP} on "
                                                f"{dp * MESH_TP} ranks)", None))
                continue
            try:
                per_rank = run_ranks(run_tp_cases, dp * tp, column, row, [name], timeout_s=timeout_s,
                                     log_dir=log_dir)
            except Exception as exc:  # a rank raised, died or hung
                failure, trace = ended_by(exc, timeout_s)
                lines.append((tp, name, "FAIL", f"{TP_CASES[name].proves}: FAILED: {failure}", trace))
                continue
            verdict_, detail = tp_verdict([r[name] for r in per_rank], tp)
            unset = next((r[name]["unset"] for r in per_rank if "unset" in r[name]), None)
            shown = TP_CASES[name].proves if verdict_ == "ok" else \
                detail if verdict_ == "skip" else f"{TP_CASES[name].proves}: FAILED: {detail}"
            lines.append((tp, name, verdict_, shown, None))
    return lines


def header(target: str) -> str:
    """What a pair is checked against, the first line of the check's output."""
    return (f"{target} (column-parallel, row-parallel) against single-process training (atol {ATOL:g}, rtol "
            f"{RTOL:g}; torch {torch.__version__}, gloo on CPU; {STEPS} SGD steps, every TP rank on the same batch):")
