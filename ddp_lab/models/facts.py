"""What a model is, counted from the module itself built on the meta device: no memory, no time, any model.

The launcher's memory estimate, the calculator and the predictor's `scale` read a model's facts here
instead of writing its architecture out again as formulas, so a model from outside the package
(examples/tied_gpt) is counted as exactly as the Transformer:

- `parameter_counts`: parameters in all (a tied weight once), and split by use: `lookup` (held by
  embeddings only: indexed, never multiplied), `matmul` (a 2-D weight of any other module: what a
  matrix multiply reads) and `other` (norms, biases);
- `flops_per_token`: forward and backward FLOPs per token of one sequence at the model's context
  length, counted by torch's `FlopCounterMode` on a meta forward and backward (matrix multiplies and
  attention's, as the kernels compute them: the full square of scores, causal or not);
- `activation_bytes`: the bytes autograd saves for backward in one forward of a micro-batch (saved
  tensors that are not parameters), fp32;
- `parameter_facts`: each parameter in `parameters()` order with the backward FLOPs per token that make
  its gradient ready, for the step replay.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from ddp_lab.models import build_model

SMALL_MODEL_BYTES = 64 * 2**20  # activations counted on a real forward of one sequence below this (see below)


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


def _key(model_cfg) -> str:
    return OmegaConf.to_yaml(model_cfg if OmegaConf.is_config(model_cfg) else OmegaConf.create(dict(model_cfg)))


def _tokens(model_cfg, batch: int = 1, device: str = "meta") -> torch.Tensor:
    return torch.zeros(batch, int(model_cfg["context_length"]), dtype=torch.long, device=device)


def parameter_counts(model_cfg) -> dict:
    """{"total", "lookup", "matmul", "other"}: parameters in all and by use (module docstring)."""
    return dict(_parameter_counts(_key(model_cfg)))


@lru_cache(maxsize=32)
def _parameter_counts(key: str) -> tuple:
    module = meta_model(OmegaConf.create(key))
    holders: dict[int, list[nn.Module]] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), []).append(m)
    counts = {"total": 0, "lookup": 0, "matmul": 0, "other": 0}
    for p in module.parameters():
        kinds = holders[id(p)]
        use = ("lookup" if all(isinstance(m, nn.Embedding) for m in kinds)
               else "matmul" if p.dim() == 2 else "other")
        counts[use] += p.numel()
        counts["total"] += p.numel()
    return tuple(counts.items())


def flops_per_token(model_cfg) -> dict:
    """{"forward", "backward", "step"}: FLOPs per token of one sequence at the model's context length."""
    return dict(_flops_per_token(_key(model_cfg)))


@lru_cache(maxsize=32)
def _flops_per_token(key: str) -> tuple:
    model_cfg = OmegaConf.create(key)
    module, tokens = meta_model(model_cfg), _tokens(model_cfg)
    with FlopCounterMode(display=False) as forward:
        logits = module(tokens)
    with FlopCounterMode(display=False) as backward:
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    n = tokens.numel()
    fwd, bwd = forward.get_total_flops() / n, backward.get_total_flops() / n
    return (("forward", fwd), ("backward", bwd), ("step", fwd + bwd))


def activation_bytes(model_cfg, batch: int) -> int:
    """Bytes autograd saves in one forward of `batch` sequences (tensors saved for backward that are not
    parameters, counted at fp32 and each time saved: an upper bound). A model under SMALL_MODEL_BYTES is
    counted on a real CPU forward of one sequence, times `batch` (what the CPU's kernels save: on the tiny
    Transformer 5% less than the meta device's decompositions), since a forward on the meta device runs
    through torch._refs, whose first use imports torch._dynamo: 2 s of every launch.py, more than that
    forward takes."""
    if 4 * parameter_counts(model_cfg)["total"] < SMALL_MODEL_BYTES:
        return batch * _activation_bytes(_key(model_cfg), 1, "cpu")
    return _activation_bytes(_key(model_cfg), batch, "meta")


@lru_cache(maxsize=32)
def _activation_bytes(key: str, batch: int, device: str) -> int:
    model_cfg = OmegaConf.create(key)
    module = meta_model(model_cfg) if device == "meta" else build_model(model_cfg)
    params = {id(p) for p in module.parameters()}
    saved = []

    def pack(tensor):
        if id(tensor) not in params and id(getattr(tensor, "_base", None)) not in params:
            saved.append(tensor.numel() * max(4, tensor.element_size()))
        return tensor

    tokens = _tokens(model_cfg, batch, device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        F.cross_entropy(module(tokens).flatten(0, 1), tokens.flatten())
    return int(sum(saved))


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
    module, tokens = meta_model(model_cfg), _tokens(model_cfg)
    with FlopCounterMode(display=False) as counter:
        module(tokens)
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
    n = tokens.numel()
    return tuple(tuple({"name": name, "numel": p.numel(), "shape": tuple(p.shape),
                        "bwd": bwd.get(id(p), 0.0) / n}.items())
                 for name, p in module.named_parameters() if p.requires_grad)
