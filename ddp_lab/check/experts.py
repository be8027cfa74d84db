"""`python -m ddp_lab.check my_pkg.MoE --ep 2,4`: does a user's expert-parallel mixture-of-experts layer train like
one process?

The layer keeps the contract of docs/check_ep.md: built from sizes by keyword (the common frameworks' names: WIDTH,
EXPERT_WIDTH, EXPERT_COUNT, TOP_K) and its expert-parallel process group (GROUP), it holds the whole router and
this rank's run of `experts / ep` experts (global expert e on group rank e // (experts / ep)), stacked along their
first dimension or in a module list; its forward maps this rank's tokens to their outputs, or to (outputs, this
rank's balancing loss), the ranks' losses averaging to one process's.

Each case builds the layer on every rank (each rank drawing its own weights) and the same class on one process (a
group of this rank alone: every expert), the one-process layer put together from the ranks' pieces (the router and
any other whole parameter from rank 0, as a data-parallel start broadcasts it), and trains both 3 SGD steps in
float64, every rank on tokens of its own, one process on every rank's: each rank's loss is its tokens' share of
one process's mean (the shares sum to it) plus its balancing loss over the ranks; after backward the check sums the
whole parameters' gradients over every rank and each expert's over its copies (the expert-data-parallel group), as
the lab's replica map does. The output, the input's gradient, the balancing loss, the router's and every expert's
gradient and the weights after the steps must equal one process's. A FAIL names the first thing that differs and
the cause it points to (`_cause`). `--dtype float32` runs both in float32 instead, for a kernel that refuses
float64 (TOLERANCES). While the layer is built and runs, memory torch.empty leaves is NaN (built.py):
rows a receive buffer never got show as NaN, on every run.
"""

from __future__ import annotations

import inspect
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddp_lab.check.built import refuses_sizes, unset_memory_as_nan, unset_weights
from ddp_lab.check.cases import locate_class
from ddp_lab.check.context import Waits, waiting
from ddp_lab.check.ranks import RanksFailed, run_ranks
from ddp_lab.check.verdict import ended_by, worst
from ddp_lab.units import KiB

D_MODEL, D_FF, EXPERTS, TOP_K, TOKENS = 16, 8, 8, 2, 12  # TOKENS per rank; EXPERTS split by ep 2 and 4
BATCH = 2  # a rank's tokens as (BATCH, TOKENS / BATCH, D_MODEL), as a Transformer block hands them over
STEPS, LR, SEED = 3, 0.1, 4321
TOLERANCES = {"float64": (1e-9, 1e-7), "float32": (1e-5, 1e-4)}
"""(atol, rtol) the output, gradients and weights must equal one process's within, by the dtype both run in
(`--dtype`): float64's rounding is about 1e-15 of values of order 1, float32's about 1e-7 (a ratio of ep or a lost
row is orders of magnitude beyond either); float32 for a kernel that refuses float64 (torch._grouped_mm)."""
WIDTH = ("d_model", "hidden_size", "dim", "model_dim", "embed_dim")
EXPERT_WIDTH = ("d_ff", "expert_d_ff", "ffn_dim", "hidden_dim", "intermediate_size", "moe_intermediate_size",
                "moe_inter_dim", "d_expert", "expert_hidden")
EXPERT_COUNT = ("num_experts", "n_experts", "experts", "n_routed_experts", "num_local_experts")
TOP_K_NAMES = ("top_k", "topk", "k", "num_experts_per_tok", "n_activated_experts")
GROUP = ("group", "ep_group", "process_group", "expert_group")
SCORE = ("score_func", "scoring_func", "router", "score")
REQUIRED = {"width": WIDTH, "experts": EXPERT_COUNT, "top_k": TOP_K_NAMES, "group": GROUP}  # the rest are optional
MESH_DP, MESH_EP = 2, 2
GLOO_LIST_ALL_TO_ALL = "ProcessGroupGloo::alltoall: invalid tensor size"
GLOO_RECEIVED_MORE = "Received data size doesn't match expected size"  # gloo's abort (ranks.py: the rank's last words)
REFUSES_FLOAT64 = ("got Double", "not implemented for 'Double'")  # torch's words where a kernel takes no float64
OUTPUT_DIFFERS = "the output differs from one process"


@dataclass(frozen=True)
class EPCase:
    name: str
    proves: str
    top_k: int = TOP_K
    score: str | None = None  # "sigmoid": run where the layer takes a score function (SCORE)
    skewed: bool = False  # the router steered: every token picks expert 0, none the last rank's experts
    frozen: bool = False  # every expert frozen
    dp: int = 1  # data-parallel copies of the ep group: dp x ep ranks, each ep group consecutive ranks


EP_CASES = {case.name: case for case in (
    EPCase("softmax", f"top-{TOP_K} routing with the layer's own scores: the output, the balancing loss, every "
           f"gradient and the weights after {STEPS} SGD steps equal one process's"),
    EPCase("sigmoid", "the same with sigmoid scores, where the layer takes a score function", score="sigmoid"),
    EPCase("top1", "top-1 routing: one expert per token", top_k=1),
    EPCase("uneven", "an uneven load: the router steered so that every token picks expert 0 and none the last "
           "rank's experts (a rank that receives no rows still joins every exchange)", skewed=True),
    EPCase("frozen", "every expert frozen: the experts never move, the router and the input still learn",
           frozen=True),
    EPCase("mesh", f"a {MESH_DP} x ep mesh of data and expert parallelism: each ep group of consecutive ranks, given "
           "to the layer as its group, and each expert's copies summed over the ranks holding it", dp=MESH_DP),
)}


def _argument(parameters, names: tuple[str, ...]) -> str | None:
    return next((name for name in names if name in parameters), None)


def arguments(cls: type) -> dict[str, str | None]:
    """The keywords the layer takes each size by: width, expert_width, experts, top_k, group, score (None where it
    takes none); ValueError where a size it needs has no keyword the check knows."""
    parameters = inspect.signature(cls).parameters
    found = {"width": _argument(parameters, WIDTH), "expert_width": _argument(parameters, EXPERT_WIDTH),
             "experts": _argument(parameters, EXPERT_COUNT), "top_k": _argument(parameters, TOP_K_NAMES),
             "group": _argument(parameters, GROUP), "score": _argument(parameters, SCORE)}
    name = f"{cls.__module__}.{cls.__qualname__}"
    for what, names in REQUIRED.items():
        if found[what] is None:
            raise ValueError(f"{name} takes no {what} keyword the expert-parallel check knows ({', '.join(names)}): "
                             "docs/check_ep.md")
    unknown = [p.name for p in parameters.values() if p.default is inspect.Parameter.empty
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in found.values()]
    if unknown:
        raise ValueError(f"{name} requires {unknown[0]!r}, which the expert-parallel check does not know how to fill "
                         f"(an expert width is one of {', '.join(EXPERT_WIDTH)}): docs/check_ep.md")
    return found


def build(cls: type, case: EPCase, group) -> nn.Module:
    """The user's layer at the case's sizes with `group` as its expert-parallel group."""
    names = arguments(cls)
    kwargs = {names["width"]: D_MODEL, names["experts"]: EXPERTS, names["top_k"]: case.top_k, names["group"]: group}
    if names["expert_width"]:
        kwargs[names["expert_width"]] = D_FF
    if case.score:
        kwargs[names["score"]] = case.score
    return cls(**kwargs)


# --- where each piece of a rank's layer lies in the one-process layer ---------------------------------------------


def placement(pieces: list[dict[str, tuple]], whole: dict[str, tuple]) -> dict:
    """{one-process name: (kind, owner ep rank, the owner's piece name)} read from the names and shapes of every ep
    rank's parameters (`pieces`, in group-rank order) and the one-process layer's (`whole`): "whole" (every rank
    holds it; owner 0), "stacked" (rows of every rank's piece, in rank order; owner None) or "listed" (one expert of
    a module list, held by one rank). Module lists are numbered from 0 on every rank (`experts.1` on rank r is global
    expert r x share + 1) or globally (`experts.5`), which rank 1's numbers tell. ValueError naming a parameter that
    fits none."""
    ep = len(pieces)
    share = EXPERTS // ep
    listed = _listed(pieces[0], whole, share)
    out = {}
    for name, shape in pieces[0].items():
        if name in listed:
            continue
        if name in whole and whole[name] == shape:
            out[name] = ("whole", 0, name)
        elif name in whole and len(shape) and whole[name][0] == shape[0] * ep and whole[name][1:] == shape[1:]:
            out[name] = ("stacked", None, name)
        else:
            raise ValueError(f"{name} {tuple(shape)} is neither the one-process layer's whole {name} nor its rows for "
                             f"{share} of {EXPERTS} experts" if name in whole else
                             f"{name} is a parameter the one-process layer does not have")
    for prefix, rest in {(prefix, rest) for prefix, _, rest in listed.values()}:
        second = _listed(pieces[1], whole, share) if ep > 1 else {}
        numbers = [index for p, index, r in second.values() if (p, r) == (prefix, rest)]
        globally = bool(numbers) and min(numbers) == share
        for expert in range(EXPERTS):
            owner = expert // share
            index = expert if globally else expert - owner * share
            out[f"{prefix}{expert}{rest}"] = ("listed", owner, f"{prefix}{index}{rest}")
    return out


_INDEX = re.compile(r"^(.*?\.)(\d+)(\..*)?$")


def _listed(pieces: dict, whole: dict, share: int) -> dict:
    """Parameters in a module list of experts: {name: (prefix, index, rest)} where the one-process layer's list
    under the same prefix holds EXPERTS entries and the piece's `share`."""
    def indexed(names):
        return {name: (m[1], int(m[2]), m[3] or "") for name in names if (m := _INDEX.match(name))}
    mine, theirs = indexed(pieces), indexed(whole)
    held, local = {}, {}
    for prefix, index, _ in theirs.values():
        held.setdefault(prefix, set()).add(index)
    for prefix, index, _ in mine.values():
        local.setdefault(prefix, set()).add(index)
    lists = {p for p in local if share < EXPERTS and len(held.get(p, ())) == EXPERTS and len(local[p]) == share}
    return {name: found for name, found in mine.items() if found[0] in lists}


def expert_names(places: dict) -> set[str]:
    """The one-process layer's parameters that are experts (split over the ranks)."""
    return {name for name, (kind, _, _) in places.items() if kind != "whole"}


# --- one case on every rank -----------------------------------------------------------------------------------


def _groups(world: int, dp: int):
    """(this rank's ep group, its expert-data-parallel group, a group of this rank alone): every rank makes every
    group, in one order."""
    ep = world // dp
    rank = dist.get_rank()
    eps = [dist.new_group(list(range(d * ep, (d + 1) * ep))) for d in range(dp)]
    edps = [dist.new_group(list(range(e, world, ep))) for e in range(ep)]
    alone = [dist.new_group([r]) for r in range(world)]
    return eps[rank // ep], edps[rank % ep], alone[rank]


def _tokens(world: int) -> list[torch.Tensor]:
    """Every rank's tokens, from one seed."""
    generator = torch.Generator().manual_seed(SEED + 1)
    return [torch.randn(BATCH, TOKENS // BATCH, D_MODEL, generator=generator, dtype=torch.float64)
            .to(torch.get_default_dtype()) for _ in range(world)]


def _steer(reference: nn.Module, layer: nn.Module, places: dict, ep: int, xs: list[torch.Tensor]) -> bool:
    """The uneven load: the router's (experts, width) weight steered on both (the last rank's experts' rows the
    opposite of expert 0's, so they are never chosen), every rank's tokens moved along expert 0's row so that most
    choose it. False where the layer has no such weight."""
    gate = next((name for name, (kind, _, _) in places.items() if kind == "whole"
                 and tuple(dict(reference.named_parameters())[name].shape) == (EXPERTS, D_MODEL)), None)
    if gate is None:
        return False
    last = range(EXPERTS - EXPERTS // ep, EXPERTS)
    for module in (reference, layer):
        weight = dict(module.named_parameters())[gate]
        with torch.no_grad():
            for e in last:
                weight[e] = -weight[0]
    direction = dict(reference.named_parameters())[gate][0].detach()
    for x in xs:
        x.add_(3 * direction / direction.norm() * x.norm(dim=-1, keepdim=True).mean())
    return True


def run_ep_case(rank: int, world: int, target: str, name: str, progress: str, dtype: str = "float64") -> dict:
    """On every rank: what differs from one process, read here (`_compare`); or what the layer raised when built,
    its weights left unset, a piece that fits nowhere."""
    torch.set_default_dtype(getattr(torch, dtype))
    cls, case = locate_class(target), EP_CASES[name]
    ep = world // case.dp
    if case.score and arguments(cls)["score"] is None:
        return {"unclaimed": f"the layer takes no score function ({', '.join(SCORE)}): its one routing is the "
                             "softmax case's"}
    group, edp, alone = _groups(world, case.dp)
    torch.manual_seed(SEED + rank)  # each rank draws its own weights; the one-process layer is put together from them
    try:
        with unset_memory_as_nan():
            layer = build(cls, case, group)
            reference = build(cls, case, alone)
    except Exception as exc:  # noqa: BLE001 - the user's refusal (or crash), reported as the case's
        said = f"{type(exc).__name__}: {exc}"
        return {"refused" if refuses_sizes(exc) else "raised": said}
    unset = unset_weights({"layer": layer})
    if unset:
        return {"unset": unset}
    held = [None] * ep
    dist.all_gather_object(held, {n: tuple(p.shape) for n, p in layer.named_parameters()}, group=group)
    try:
        places = placement(held, {n: tuple(p.shape) for n, p in reference.named_parameters()})
    except ValueError as exc:
        return {"pieces": str(exc)}
    _put_together(reference, layer, places, ep, world)
    xs = _tokens(world)
    if case.skewed and not _steer(reference, layer, places, ep, xs):
        return {"unclaimed": f"the layer has no ({EXPERTS}, {D_MODEL}) router weight to steer"}
    if case.frozen:
        experts = expert_names(places)
        ep_rank = dist.get_rank(group)
        for param, p in reference.named_parameters():
            if param in experts:
                p.requires_grad_(False)
        for param, (p, _, _) in _pieces_of(layer, reference, places, ep_rank, ep).items():
            if param in experts:
                p.requires_grad_(False)
    exchanged = Exchanged(Path(progress, f"rank{rank}.{name}.cp"), group)
    with unset_memory_as_nan():
        found = _compare(reference, layer, places, xs, rank, world, group, edp, case.dp, exchanged,
                         TOLERANCES[dtype])
    return {**found, "row_bytes": exchanged.row_bytes, "load": exchanged.load, "others_rows": exchanged.others_rows,
            "counted": exchanged.counted}


class Exchanged(Waits):
    """Waits (the call a rank is blocked in, for a hang) and what the layer's all-to-alls carried: the bytes of
    float rows sent to the other ranks (its own never leave it), and, from an all-to-all of `EXPERTS` integers (the
    counts' exchange), this rank's rows per expert and how many of them live on other ranks."""

    def __init__(self, path: Path, group):
        super().__init__(path)
        self.group, self.row_bytes, self.others_rows, self.counted = group, 0, 0, False
        self.load = torch.zeros(EXPERTS, dtype=torch.long)

    def _count(self, name: str, args, kwargs) -> None:
        super()._count(name, args, kwargs)
        given = args[1] if len(args) > 1 else kwargs.get("input")
        if name != "all_to_all_single" or not torch.is_tensor(given):
            return
        ep, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        if not given.is_floating_point():
            self.counted = True  # counts of some kind (per expert, per rank, or each row's expert) went ahead
            if given.numel() == EXPERTS:
                counts = given.detach().flatten().long()
                self.load += counts
                share = EXPERTS // ep
                self.others_rows += int(counts.sum() - counts[me * share:(me + 1) * share].sum())
            return
        splits = kwargs.get("input_split_sizes") or (args[3] if len(args) > 3 else None)
        rows = given.shape[0]
        mine = splits[me] if splits else rows // ep
        self.row_bytes += (rows - mine) * (given[:1].numel() * given.element_size())


def _put_together(reference: nn.Module, layer: nn.Module, places: dict, ep: int, world: int) -> None:
    """The one-process layer from the pieces of the first ep group (its whole parameters from rank 0), and every
    rank's layer given the pieces of its place in that group: as a data-parallel start broadcasts them."""
    mine = {n: p.detach().clone() for n, p in layer.named_parameters()}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    whole_here = {where for kind, _, where in places.values() if kind == "whole"}
    with torch.no_grad():
        for n, p in layer.named_parameters():
            p.copy_(everyone[0][n] if n in whole_here else everyone[dist.get_rank() % ep][n])
        params = dict(reference.named_parameters())
        for name, (kind, owner, where) in places.items():
            value = torch.cat([everyone[r][where] for r in range(ep)]) if kind == "stacked" else everyone[owner][where]
            params[name].copy_(value)


def _call(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = module(x)
    if isinstance(out, tuple):
        return out[0], (out[1] if len(out) > 1 and torch.is_tensor(out[1]) else None)
    return out, None


def _differs(got, expected, tolerance: tuple[float, float]) -> float | None:
    if got is None or expected is None:
        return None if got is expected else float("inf")
    if got.shape != expected.shape or not torch.isfinite(got).all():
        return float("inf")
    if torch.allclose(got, expected, atol=tolerance[0], rtol=tolerance[1]):
        return None
    return (got - expected).abs().max().item()


def _ratio(got, expected, tolerance: tuple[float, float]) -> float | None:
    """got / expected where one factor (within the tolerance) makes them equal, else None."""
    if got is None or expected is None or got.shape != expected.shape or expected.abs().max() == 0:
        return None
    factor = float((got * expected).sum() / (expected * expected).sum())
    return factor if torch.allclose(got, factor * expected, atol=tolerance[0], rtol=tolerance[1]) else None


def _pieces_of(layer: nn.Module, reference: nn.Module, places: dict, ep_rank: int, ep: int) -> dict:
    """{one-process name: (this rank's tensor, the one-process parameter, the rows of it this rank holds or None for
    all)} for every parameter this rank holds."""
    mine, whole = dict(layer.named_parameters()), dict(reference.named_parameters())
    share = EXPERTS // ep
    out = {}
    for name, (kind, owner, where) in places.items():
        if kind == "stacked":
            out[name] = (mine[where], whole[name], slice(ep_rank * share, (ep_rank + 1) * share))
        elif kind == "whole" or owner == ep_rank:
            out[name] = (mine[where], whole[name], None)
    return out


def _rows(t: torch.Tensor | None, rows: slice | None) -> torch.Tensor | None:
    return None if t is None else (t if rows is None else t[rows]).detach().clone()


def _grad(t):
    return None if t.grad is None else t.grad.detach().clone()


def _compare(reference, layer, places, xs, rank, world, group, edp, dp, exchanged: Exchanged,
             tolerance: tuple[float, float]) -> dict:
    """Both trained on the same tokens; this rank's findings."""
    ep, ep_rank = world // dp, dist.get_rank(group)
    mine = xs[rank].clone()
    whole = torch.cat(xs)
    share = slice(rank * BATCH, (rank + 1) * BATCH)
    generator = torch.Generator().manual_seed(SEED + 2)
    target = torch.randn(whole.shape, generator=generator, dtype=torch.float64).to(whole.dtype)
    optimizers = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=LR) for m in (reference, layer)]
    experts = expert_names(places)
    found: dict = {"rank": rank, "tolerance": tolerance}
    for step in range(STEPS):
        given = mine.clone().requires_grad_(True)
        with exchanged.watching():
            y, aux = _call(layer, given)
        everything = whole.clone().requires_grad_(True)
        y_ref, aux_ref = _call(reference, everything)
        balance = dp == 1 and aux is not None and aux_ref is not None  # a layer balances over its own ep group
        loss = F.mse_loss(y, target[share], reduction="sum") / whole.numel() + (aux / world if balance else 0)
        loss_ref = F.mse_loss(y_ref, target, reduction="sum") / whole.numel() + (aux_ref if balance else 0)
        if step == 0:
            found["nan_output"] = not torch.isfinite(y.detach()).all()
            found["output"] = _differs(y.detach(), y_ref.detach()[share], tolerance)
            found["aux"] = None if not balance else (aux.detach().clone(), aux_ref.detach().clone())
            found["router_dead"] = _router_dead(reference, places, experts, y_ref, target)
        with exchanged.watching():
            loss.backward()
        loss_ref.backward()
        _synchronize(layer, places, experts, edp, ep_rank)
        pairs = _pieces_of(layer, reference, places, ep_rank, ep)
        if step == 0:
            found["input_grad"] = _differs(_grad(given), everything.grad[share], tolerance)
            found["grads"] = {name: (_grad(got), _rows(ref.grad, rows))
                              for name, (got, ref, rows) in pairs.items() if ref.requires_grad}
            found["experts"] = sorted(experts)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    held = _pieces_of(layer, reference, places, ep_rank, ep)
    found["weights"] = {name: _differs(got.detach(), _rows(ref, rows), tolerance)
                        for name, (got, ref, rows) in held.items()}
    found["frozen_moved"] = [name for name, (got, ref, rows) in held.items()
                             if not ref.requires_grad and found["weights"][name] is not None]
    return found


def _router_dead(reference, places, experts, y_ref, target) -> bool | None:
    """Whether the one-process layer's router gets no gradient through the output alone (the combine): its gates
    detached, or its scores never applied. None where it has no (experts, width) router weight."""
    params = dict(reference.named_parameters())
    gate = next((params[n] for n in places if n not in experts and tuple(params[n].shape) == (EXPERTS, D_MODEL)
                 and params[n].requires_grad), None)
    if gate is None:
        return None
    (grad,) = torch.autograd.grad(F.mse_loss(y_ref, target, reduction="sum"), [gate], retain_graph=True,
                                  allow_unused=True)
    return grad is None or not bool(grad.abs().max() > 0)


def _synchronize(layer, places, experts, edp, ep_rank: int) -> None:
    """As the lab's replica map: whole parameters' gradients summed over every rank, each expert's over its copies
    (the expert-data-parallel group); the losses are shares of one process's, so sums, not means."""
    split = {where for name, (kind, owner, where) in places.items() if name in experts and owner in (None, ep_rank)}
    for name, p in layer.named_parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=edp if name in split else None)


# --- the verdict, from every rank's findings ----------------------------------------------------------------------


def ep_verdict(per_rank: list[dict], ep: int) -> tuple[str, str | None]:
    first = per_rank[0]
    for key in ("unclaimed", "refused"):
        if key in first:
            return "skip", first[key] if key == "unclaimed" else f"refused when built at ep {ep}: {first[key]}"
    for key in ("unset", "pieces", "raised"):
        found = next((r[key] for r in per_rank if key in r), None)
        if found:
            return "FAIL", found if key != "raised" else f"the layer raised when built: {found}"
    cause = _cause(per_rank, ep)
    return ("FAIL", cause) if cause else ("ok", None)


def _cause(per_rank: list[dict], ep: int) -> str | None:
    """The first thing that differs from one process, and what it points to."""
    tolerance = per_rank[0].get("tolerance", TOLERANCES["float64"])
    nan = [r["rank"] for r in per_rank if r["nan_output"]]
    if nan:
        return (f"rank {nan[0]}'s output holds rows its receive buffer never got (NaN: the check fills unset memory "
                "with it): the receive sizes are not the sizes sent; exchange the counts first (one all-to-all of "
                "the rows per expert)")
    frozen = sorted({n for r in per_rank for n in r["frozen_moved"]})
    if frozen:
        return f"a frozen parameter moved ({', '.join(frozen)})"
    output = worst(per_rank, "output")
    if output:
        rank, diff = output
        if not any(r["counted"] for r in per_rank):
            return (f"{OUTPUT_DIFFERS} (rank {rank}: max |difference| {diff:.3g}) and no rank "
                    "exchanged counts (no all-to-all of integers was seen): the receive sizes and each expert's share "
                    "of them are guesses; exchange the counts first (one all-to-all of the rows per expert)")
        return (f"{OUTPUT_DIFFERS} (rank {rank}: max |difference| {diff:.3g}) with the same "
                "weights on both: the rows' trip is wrong (the permutation back not the inverse of the one out, "
                "each row back to another token, or a split sent to the wrong rank)")
    dead = per_rank[0]["router_dead"]
    if dead:
        return ("the router gets no gradient through the output, on one process too: the combine's weights are "
                "detached from the router, or the scores are never applied (it learns from the balancing loss alone, "
                "if it has one)")
    aux = per_rank[0]["aux"]
    if aux is not None:
        mean = sum(float(r["aux"][0]) for r in per_rank) / len(per_rank)
        expected = float(aux[1])
        if abs(mean - expected) > tolerance[0] + tolerance[1] * abs(expected):
            return (f"the balancing loss differs from one process's over every rank's tokens (the ranks' mean "
                    f"{mean:.6g}, one process {expected:.6g}): a per-rank loss, each rank's load and probabilities "
                    "its own tokens'; sum the counts over the ranks (and scale this rank's share so the ranks' mean "
                    "is the loss)")
    experts = set(per_rank[0]["experts"])
    none = sorted({n for r in per_rank for n, (got, ref) in r["grads"].items()
                   if n in experts and (got is None or ref is None)})
    if none:  # on one process too: the one-process layer runs the same exchange, on a group of one
        return (f"no expert trains: the gradient of {', '.join(none[:3])}{' ...' if len(none) > 3 else ''} is None "
                "while the output is right: the all-to-all runs outside autograd (a plain all_to_all_single on "
                "detached rows; wrap it in an autograd Function whose backward sends the gradients back)")
    ratios = [_ratio(got, ref, tolerance) for r in per_rank for n, (got, ref) in r["grads"].items()
              if n in experts and got is not None and _differs(got, ref, tolerance) is not None]
    near = 10 * tolerance[1]  # factors that agree to the dtype's rounding
    if ratios and all(q is not None for q in ratios) and max(ratios) - min(ratios) < near * abs(max(ratios)):
        factor = ratios[0]
        times = f"{factor:.4g} times" if abs(factor - round(factor)) > near else f"{round(factor)} times"
        hint = f" (ep = {ep}: averaged, or scaled, as if the experts were copies on the ep ranks)" \
            if abs(factor - ep) < near * ep or abs(factor - 1 / ep) < near else ""
        return (f"every expert's gradient is {times} one process's while the output is right{hint}: an expert's "
                "gradient already sums every rank's tokens through the combine's backward")
    wrong = sorted({n for r in per_rank for n, (got, ref) in r["grads"].items()
                    if _differs(got, ref, tolerance) is not None})
    if wrong:
        kind = "an expert's" if set(wrong) <= experts else "a parameter's"
        return f"{kind} gradient differs while the output is right ({', '.join(wrong[:4])})"
    input_grad = worst(per_rank, "input_grad")
    if input_grad:
        rank, diff = input_grad
        return (f"the input's gradient differs (rank {rank}: max |difference| {diff:.3g}) while every parameter's is "
                "right: the dispatch's backward does not send each row's gradient back to the rank it came from")
    weights = sorted({n for r in per_rank for n, d in r["weights"].items() if d is not None})
    if weights:
        return f"the weights after {STEPS} SGD steps differ ({', '.join(weights[:4])}) though the first step was right"
    return None


def seen_line(per_rank: list[dict], ep: int) -> str:
    """The rows' bytes the layer's all-to-alls sent to other ranks (every rank's, over the steps, forward and
    backward), beside the formula at the load its counts' exchange showed; the load per expert."""
    sent = sum(r["row_bytes"] for r in per_rank)
    load = sum(r["load"] for r in per_rank)
    if not int(load.sum()):
        return (f"the layer's all-to-alls sent {sent / KiB:.1f} KiB of rows to other ranks over {STEPS} steps; no "
                f"all-to-all of {EXPERTS} integers (the counts' exchange) was seen, so the load is not known")
    others = sum(r["others_rows"] for r in per_rank)
    formula = 4 * others * D_MODEL * 8
    per_expert = " ".join(str(int(n)) for n in load)
    return (f"rows to other ranks: {sent / KiB:.1f} KiB sent over {STEPS} steps, the formula 4 (dispatch, combine, "
            f"each forward and backward) x {others} rows routed off-rank x {D_MODEL} x 8 B = {formula / KiB:.1f} "
            f"KiB; rows per expert over the steps: {per_expert}")


# --- run from the command line ------------------------------------------------------------------------------------


def check_layer(target: str, degrees: list[int], names: list[str], timeout_s: float, log_dir: str,
                dtype: str = "float64") -> list[tuple]:
    """(ep, case, verdict, detail, a crashed rank's traceback or None) per case and degree, each case in a set of
    ranks of its own."""
    cls = locate_class(target)
    if not issubclass(cls, nn.Module):
        raise ValueError(f"{target} is not a torch.nn.Module class")
    arguments(cls)
    for ep in degrees:
        if EXPERTS % ep:
            raise ValueError(f"--ep {ep}: the check's layer has {EXPERTS} experts; take a degree that divides it")
    lines, unset, top_1_forward_right = [], False, set()
    for ep in degrees:
        for name in names:
            case = EP_CASES[name]
            if unset:
                lines.append((ep, name, "skip", "not run: the layer's weights are not finite after it is built (the "
                                                "FAIL above)", None))
                continue
            if case.dp > 1 and ep != MESH_EP:
                lines.append((ep, name, "skip", f"the mesh case runs at ep {MESH_EP} ({case.dp} x {MESH_EP} on "
                                                f"{case.dp * MESH_EP} ranks)", None))
                continue
            world = case.dp * ep
            with tempfile.TemporaryDirectory() as progress:
                try:
                    per_rank = run_ranks(run_ep_case, world, target, name, progress, dtype, timeout_s=timeout_s,
                                         log_dir=log_dir)
                except Exception as exc:  # a rank raised, died or hung
                    failure, trace = ended_by(exc, timeout_s)
                    if isinstance(exc, RanksFailed) and exc.timed_out:
                        failure = f"still running after {timeout_s:g} s: {waiting(progress, name, world)}"
                    elif trace is not None and dtype == "float64" and any(w in trace for w in REFUSES_FLOAT64):
                        failure = f"{failure}: a kernel that refuses float64: run the check with --dtype float32"
                    elif trace is not None and GLOO_LIST_ALL_TO_ALL in trace:
                        failure = (f"{failure}: not checkable on gloo as written: gloo's all_to_all (the list form) "
                                   "takes tensors of one size only, where NCCL takes any; send the rows with "
                                   "all_to_all_single and split sizes to be checked here")
                    elif GLOO_RECEIVED_MORE in failure:
                        failure = (f"{failure}: gloo aborted it on a receive larger than its buffer: the receive sizes "
                                   "are not the sizes sent; exchange the counts first (one all-to-all of the rows per "
                                   "expert)")
                    lines.append((ep, name, "FAIL", f"{case.proves}: FAILED: {failure}", trace))
                    continue
            verdict_, detail = ep_verdict(per_rank, ep)
            if name == "top1" and all(r.get("output", 1) is None and not r["nan_output"] for r in per_rank):
                top_1_forward_right.add(ep)
            unset = any("unset" in r for r in per_rank)
            shown = case.proves if verdict_ == "ok" else detail if verdict_ == "skip" else \
                f"{case.proves}: FAILED: {detail}"
            lines.append((ep, name, verdict_, shown, None))
            if verdict_ != "skip" and "row_bytes" in per_rank[0]:
                lines.append((ep, name, "seen", seen_line(per_rank, ep), None))
    return _top_1_tells(lines, top_1_forward_right)


def _top_1_tells(lines: list[tuple], right: set[int]) -> list[tuple]:
    """Where top-1 routing's output is right at a degree (`right`) and top-2's is not, a token's second row is what
    goes wrong: said in those lines."""
    hint = ("; top-1 routing's output is right at this degree, so a token's second expert is what goes wrong: where "
            "both of a token's rows come back to it, an indexed `out[tokens] += rows` keeps one of them (repeated "
            "indices write once; index_add_ sums them)")
    return [(ep, name, verdict_, detail + hint if verdict_ == "FAIL" and ep in right and f"FAILED: {OUTPUT_DIFFERS}"
             in detail else detail, trace) for ep, name, verdict_, detail, trace in lines]


def header(target: str, dtype: str = "float64") -> str:
    atol, rtol = TOLERANCES[dtype]
    return (f"{target} (expert-parallel) against single-process training ({dtype}, atol {atol:g}, rtol {rtol:g}; "
            f"torch {torch.__version__}, gloo on CPU; {EXPERTS} experts, width {D_MODEL}, expert width {D_FF}, "
            f"{TOKENS} tokens a rank, {STEPS} SGD steps):")
