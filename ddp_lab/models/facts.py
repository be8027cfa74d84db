"""What a model is, counted from the module itself built on the meta device: no memory, no time, any model.

The launcher's memory estimate, the calculator and the predictor's `scale` read a model's facts here
instead of writing its architecture out again as formulas, so a model from outside the package
(examples/tied_gpt) is counted as exactly as the Transformer:

- `parameter_counts`: parameters in all (a tied weight once), and split by use: `lookup` (held by
  embeddings only: indexed, never multiplied), `matmul` (a 2-D weight of any other module, or a mixture's stacked
  experts: what a matrix multiply reads) and `other` (norms, biases); and `active`, those one token's forward reads
  (a mixture of experts' token reaches top_k of them; all of a dense model's);
- `flops_per_token`: forward and backward FLOPs per token of one sequence at the model's context
  length, counted by torch's `FlopCounterMode` on a meta forward and backward (matrix multiplies and
  attention's, as the kernels compute them: the full square of scores, causal or not);
- `activation_bytes`: the bytes autograd saves for backward in one forward of a micro-batch (saved
  tensors that are not parameters), fp32, counted at small sizes and scaled (the launcher's checks must never
  run the model at the size they are asked about: a check costs what the job costs);
- `parameter_facts`: each parameter in `parameters()` order with the backward FLOPs per token that make
  its gradient ready, for the step replay;
- `tp_layers`: the model's tensor-parallel plan with its layers' weight shapes and the parameters whose
  gradients tensor parallelism sums under sequence parallelism (spec/parallel.py's `tp_schedule` reads them).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from ddp_lab.models import build_model


class _SkipInit(TorchFunctionMode):
    """`torch.nn.init`'s fills skipped: on the meta device they are no-ops that run through torch._refs,
    whose first use imports torch._dynamo (2 s of every launch.py on 2 cores)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def meta_model(model_cfg) -> nn.Module:
    """The model of `model_cfg` built on the meta device (ValueError, TypeError: it cannot be built)."""
    with torch.device("meta"), _SkipInit():
        return build_model(model_cfg)


def ties_of(model: nn.Module) -> list[list[str]]:
    """The names of each parameter `model` holds under more than one name (a tied embedding and head)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def tp_layers(module: nn.Module) -> tuple[dict, dict, dict]:
    """(plan, weight shapes, partial gradients) of a module (any device): its `tp_plan()` ({} without one), each
    planned layer's weight shape, and for each planned layer the elements of its trainable parameters kept whole
    on every TP rank but applied to its tokens only under sequence parallelism (a norm's weight, a row-parallel
    layer's bias), whose gradients TP sums there."""
    from ddp_lab.spec.parallel import Rowwise, SequenceNorm

    plan = module.tp_plan() if hasattr(module, "tp_plan") else {}
    shapes, partial = {}, {}
    for name, style in plan.items():
        layer = module.get_submodule(name)
        if isinstance(getattr(layer, "weight", None), torch.Tensor):
            shapes[name] = tuple(layer.weight.shape)
        if isinstance(style, SequenceNorm):
            partial[name] = sum(p.numel() for p in layer.parameters(recurse=False) if p.requires_grad)
        elif isinstance(style, Rowwise) and getattr(layer, "bias", None) is not None and layer.bias.requires_grad:
            partial[name] = layer.bias.numel()
    return plan, shapes, partial


def _key(model_cfg) -> str:
    return OmegaConf.to_yaml(model_cfg if OmegaConf.is_config(model_cfg) else OmegaConf.create(dict(model_cfg)))


def _tokens(model_cfg, batch: int = 1, device: str = "meta") -> torch.Tensor:
    return torch.zeros(batch, int(model_cfg["context_length"]), dtype=torch.long, device=device)


def _input(module: nn.Module, model_cfg, batch: int = 1, device: str = "meta") -> torch.Tensor:
    """What the model's forward takes: token ids, or what its `example_input` says (models/ffn.py's activations)."""
    if hasattr(module, "example_input"):
        return module.example_input(batch, device=device)
    return _tokens(model_cfg, batch, device)


def _loss(output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """The next-token cross-entropy of logits; a model from activations to activations gets their sum (which saves
    nothing and costs no FLOP: the backward's FLOPs and saved tensors are the model's own)."""
    if inputs.dtype == torch.long:
        return F.cross_entropy(output.flatten(0, 1), inputs.flatten())
    return output.sum()


def parameter_counts(model_cfg) -> dict:
    """{"total", "lookup", "matmul", "other", "active"}: parameters in all and by use (module docstring; an expert's
    stacked weights are matmul weights), and those one token's forward reads (`active`: a mixture's token reaches
    top_k of its experts; the total for a dense model). A model deeper
    than MEASURED_DEPTHS or with a context longer than MEASURED_CONTEXTS is counted at those sizes and scaled
    (`_scaled`): the count never builds the model at the size asked for."""
    return dict(_parameter_counts(_key(model_cfg)))


@lru_cache(maxsize=32)
def _parameter_counts(key: str) -> tuple:
    model_cfg = OmegaConf.create(key)
    depth, context = _depth(model_cfg), int(model_cfg["context_length"])
    if (depth is None or depth <= MEASURED_DEPTHS[-1]) and context <= MEASURED_CONTEXTS[-1]:
        return tuple(_counts_of(meta_model(model_cfg)).items())
    at = {(n, length): _counts_of(meta_model(_resized(model_cfg, n, length)))
          for n in _depths(depth) for length in MEASURED_CONTEXTS[:2]}
    return tuple((kind, int(round(_scaled({k: v[kind] for k, v in at.items()}, depth, context, degree=1))))
                 for kind in ("total", "lookup", "matmul", "other", "active"))


def _counts_of(module: nn.Module) -> dict:
    holders: dict[int, list[nn.Module]] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), []).append(m)
    counts = {"total": 0, "lookup": 0, "matmul": 0, "other": 0}
    for p in module.parameters():
        kinds = holders[id(p)]
        use = ("lookup" if all(isinstance(m, nn.Embedding) for m in kinds)
               else "matmul" if p.dim() == 2 or any(getattr(m, "expert_parallel", False) for m in kinds)
               else "other")
        counts[use] += p.numel()
        counts["total"] += p.numel()
    from ddp_lab.models.moe import moe_layers

    idle = sum(sum(p.numel() for p in layer.experts.parameters()) * (layer.num_experts - layer.top_k)
               // layer.num_experts for layer in moe_layers(module))
    counts["active"] = counts["total"] - idle  # a mixture's token reaches top_k of its experts
    return counts


# --- counting at small sizes and scaling: what the launcher's checks do, in bounded time ---------------------

DEPTH_KEY = "num_layers"
"""A model config's key for its number of identical blocks, when it has one (the Transformer, examples/tied_gpt)."""
MEASURED_DEPTHS = (1, 2)
MEASURED_CONTEXTS = (16, 32, 64)
REAL_FORWARD_BYTES = 512 * 2**20
"""A model measured at the small sizes whose parameters take at most this is run for real on the CPU (its
weights left uninitialized: sizes, not values, are counted); a larger one on the meta device."""


def _depth(model_cfg) -> int | None:
    value = model_cfg.get(DEPTH_KEY) if hasattr(model_cfg, "get") else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _depths(depth: int | None) -> tuple:
    return (None,) if depth is None else MEASURED_DEPTHS if depth > MEASURED_DEPTHS[-1] else (depth,)


def _resized(model_cfg, depth: int | None, context: int):
    """The same model at `depth` blocks (None: as it is) and `context` tokens."""
    changes = {"context_length": context, **({DEPTH_KEY: depth} if depth is not None else {})}
    return OmegaConf.merge(model_cfg, changes)


def bounded_size(model_cfg):
    """The model at no more than MEASURED_DEPTHS[-1] blocks and MEASURED_CONTEXTS[-1] tokens: its kinds of
    layers, built in bounded time."""
    depth = _depth(model_cfg)
    return _resized(model_cfg, None if depth is None else min(depth, MEASURED_DEPTHS[-1]),
                    min(int(model_cfg["context_length"]), MEASURED_CONTEXTS[-1]))


def _scaled(at: dict, depth: int | None, context: int, degree: int) -> float:
    """A quantity measured at (depth, context) points, at the model's own depth and context. The scaling: linear
    in the number of identical blocks (what one more block adds, from depths 1 and 2), and in the context a
    polynomial of `degree` through the measured contexts (1: parameters, a learned position table being the
    only thing that grows with it; 2: activations, per-token tensors and attention's scores); exact for a model
    whose blocks are alike and whose saved tensors are at most quadratic in the context."""
    def at_depth(n):
        points = sorted((length, value) for (m, length), value in at.items() if m == n)
        if len(points) == 1 or context == points[0][0]:
            return points[0][1]
        return _polynomial(points[:degree + 1], context)

    depths = sorted({n for n, _ in at}, key=lambda n: -1 if n is None else n)
    if len(depths) == 1:
        return at_depth(depths[0])
    one, two = at_depth(depths[0]), at_depth(depths[1])
    return one + (depth - depths[0]) * (two - one)


def _polynomial(points: list[tuple[int, float]], x: int) -> float:
    """The polynomial through `points` (Lagrange's form), at `x`."""
    total = 0.0
    for i, (xi, yi) in enumerate(points):
        term = float(yi)
        for j, (xj, _) in enumerate(points):
            if j != i:
                term *= (x - xj) / (xi - xj)
        total += term
    return total


def flops_per_token(model_cfg) -> dict:
    """{"forward", "backward", "step"}: FLOPs per token of one sequence at the model's context length."""
    return dict(_flops_per_token(_key(model_cfg)))


@lru_cache(maxsize=32)
def _flops_per_token(key: str) -> tuple:
    model_cfg = OmegaConf.create(key)
    module = meta_model(model_cfg)
    inputs = _input(module, model_cfg)
    with FlopCounterMode(display=False) as forward:
        output = module(inputs)
    with FlopCounterMode(display=False) as backward:
        _loss(output, inputs).backward()
    n = inputs.shape[0] * inputs.shape[1]
    fwd, bwd = forward.get_total_flops() / n, backward.get_total_flops() / n
    return (("forward", fwd), ("backward", bwd), ("step", fwd + bwd))


def activation_bytes(model_cfg, batch: int) -> int:
    """Bytes autograd saves in one forward of `batch` sequences (tensors saved for backward that are not
    parameters, counted at fp32 and each time saved: an upper bound), from shapes at a bounded cost: counted
    on one sequence at the small sizes (at most MEASURED_DEPTHS blocks, MEASURED_CONTEXTS tokens) and scaled
    to the model's depth and context (`_scaled`), then times `batch` (a batch-independent saved tensor counted
    once per sequence: generous). At the small sizes a model of at most REAL_FORWARD_BYTES of parameters runs a
    real CPU forward, weights uninitialized (what the CPU's kernels save: its attention saves no score matrix);
    a larger one runs on the meta device, whose attention decomposition saves the scores (generous), and whose
    first use imports torch._dynamo (2 s)."""
    depth, context = _depth(model_cfg), int(model_cfg["context_length"])
    contexts = (context,) if context <= MEASURED_CONTEXTS[-1] else MEASURED_CONTEXTS
    small = _resized(model_cfg, _depths(depth)[-1], contexts[-1])
    device = "cpu" if 4 * parameter_counts(small)["total"] <= REAL_FORWARD_BYTES else "meta"
    at = {}
    for n in _depths(depth):
        for length in contexts:
            at[(n, length)] = _activation_bytes(_key(_resized(model_cfg, n, length)), 1, device)
    return int(round(batch * max(0.0, _scaled(at, depth, context, degree=2))))


@lru_cache(maxsize=64)
def _activation_bytes(key: str, batch: int, device: str) -> int:
    """What autograd saves in one forward of `batch` sequences of the model of `key`, as it is, on `device`
    ("cpu": a real forward, weights uninitialized; "meta")."""
    model_cfg = OmegaConf.create(key)
    module = meta_model(model_cfg)
    if device != "meta":
        # real storage, never initialized (sizes are what is counted); torch.empty, not to_empty's empty_like,
        # which on a meta tensor runs through torch._refs and imports its registrations (0.7 s)
        module = module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    inputs = _input(module, model_cfg, batch, device)
    with counting_saved(module) as saved:
        _loss(module(inputs), inputs)
    return int(sum(saved))


@contextmanager
def counting_saved(module: nn.Module):
    """A list that fills, inside the block, with the bytes of each tensor autograd saves that is not one of
    `module`'s parameters (fp32 or wider, each time saved: the upper bound the calculator counts)."""
    params = {id(p) for p in module.parameters()}
    saved: list[int] = []

    def pack(tensor):
        if id(tensor) not in params and id(getattr(tensor, "_base", None)) not in params:
            saved.append(tensor.numel() * max(4, tensor.element_size()))
        return tensor.detach()  # not the tensor itself, a cycle through its node (rank/activations.py says why)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved


def parameter_facts(model_cfg) -> list[dict]:
    """Each trainable parameter in `parameters()` order: name, numel, shape, and `bwd`, the backward FLOPs per
    token that make its gradient ready: twice the forward FLOPs of the module holding it (a matmul's
    backward computes two products of its forward's size), split over that module's own parameters by
    size; what a parent computes itself, between its children (attention's scores), goes to its first
    parameter-holding descendant, whose gradient is computed after it. Forward FLOPs are counted per
    module by `FlopCounterMode` (its split of backward over modules is not reliable, its forward's is)."""
    return [dict(p) for p in _parameter_facts(_key(model_cfg))]


@lru_cache(maxsize=32)
def _parameter_facts(key: str) -> tuple:
    model_cfg = OmegaConf.create(key)
    module = meta_model(model_cfg)
    inputs = _input(module, model_cfg)
    with FlopCounterMode(display=False) as counter:
        module(inputs)
    totals = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    root = type(module).__name__

    def total(name: str, m: nn.Module) -> float:
        """A module's forward FLOPs; a container that never ran forward itself (a ModuleList): its children's."""
        key = f"{root}.{name}" if name else root
        return totals[key] if key in totals else sum(total(f"{name}.{c}" if name else c, child)
                                                     for c, child in m.named_children())

    bwd: dict[int, float] = {}
    for name, m in module.named_modules():
        own = total(name, m) - sum(total(f"{name}.{c}" if name else c, child) for c, child in m.named_children())
        mine = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if own and not mine:  # computed between its children: counted with its first parameter-holding one
            holder = next((d for d in m.modules() if any(p.requires_grad for p in d.parameters(recurse=False))), None)
            mine = [p for p in holder.parameters(recurse=False) if p.requires_grad] if holder is not None else []
        size = sum(p.numel() for p in mine)
        for p in mine:
            bwd[id(p)] = bwd.get(id(p), 0.0) + 2 * own * p.numel() / size
    n = inputs.shape[0] * inputs.shape[1]
    return tuple(tuple({"name": name, "numel": p.numel(), "shape": tuple(p.shape),
                        "bwd": bwd.get(id(p), 0.0) / n}.items())
                 for name, p in module.named_parameters() if p.requires_grad)
