"""`parallel.tp_impl=torch`: the same plan applied by torch's DTensor `parallelize_module`, the in-run reference.

Each style of spec/parallel.py becomes torchtitan's ParallelStyle for it (its Llama plan): the embedding
`RowwiseParallel` (output replicated, or sharded by sequence), norms `SequenceParallel` under sequence
parallelism, `PrepareModuleInput` where the lab prepares an input once, column-wise layers
`ColwiseParallel`, row-wise `RowwiseParallel`, the head `ColwiseParallel` with its logits left a DTensor
sharded by vocabulary for `loss_parallel`. DTensor cuts the vocabulary unevenly (`torch.chunk`) where the lab
pads it.

Two adaptations, each undone when weights are gathered whole (layout.py's index map):

- a fused projection (the Transformer's q, k, v in one weight) has its rows reordered first so that DTensor's
  contiguous row blocks are the lab's pieces (each rank's heads of q, of k and of v): the same forward then
  runs both implementations;
- the DTensor parameters are kept as plain local tensors between forwards (torch's own
  `_pre_dp_module_transform` idea, per module): each forward rebuilds its DTensor views from them with
  `DTensor.from_local`, whose backward hands the local gradient back. So every data-parallel strategy, the
  lab's and torch's, sees ordinary parameters and gradients, exactly as with the lab's layers.
"""

from __future__ import annotations

import torch
from torch import nn

from ddp_lab.spec.parallel import Colwise, PrepareInput, Rowwise, SequenceNorm, Style, VocabEmbedding, VocabHead
from ddp_lab.tensor_parallel.layers import in_forward
from ddp_lab.tensor_parallel.layout import Split, TPLayout, shard
from ddp_lab.tensor_parallel.loss import CrossEntropy, LossParallel


def parallelize(module: nn.Module, plan: dict[str, Style], device_mesh, sequence_parallel: bool,
                layout: TPLayout) -> CrossEntropy:
    """Apply `plan` with DTensor on the `tp` mesh `device_mesh`, in place; the loss its output takes."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = device_mesh.size()
    seq = Shard(1) if sequence_parallel else Replicate()
    prepared = [name for name, style in plan.items() if isinstance(style, PrepareInput)]
    names_of = _names_by_parameter(module)
    splits: dict[int, tuple[tuple, Split]] = {}
    styles = {}
    for name, style in plan.items():
        sub = module.get_submodule(name)
        if isinstance(style, Colwise) and style.chunks > 1:
            _interleave_chunks(sub, style.chunks, tp)
        if isinstance(style, (Colwise, VocabHead, VocabEmbedding)):
            split = Split(0, style.chunks if isinstance(style, Colwise) else 1)
            splits[id(sub.weight)] = (tuple(sub.weight.shape), split)
            if getattr(sub, "bias", None) is not None:
                splits[id(sub.bias)] = (tuple(sub.bias.shape), split)
        elif isinstance(style, Rowwise):
            splits[id(sub.weight)] = (tuple(sub.weight.shape), Split(1))
        inside = any(name.startswith(p + ".") for p in prepared)
        if isinstance(style, VocabEmbedding):
            styles[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        elif isinstance(style, SequenceNorm):
            if sequence_parallel:
                styles[name] = SequenceParallel()
        elif isinstance(style, PrepareInput):
            styles[name] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        elif isinstance(style, Colwise):
            styles[name] = ColwiseParallel() if inside else ColwiseParallel(input_layouts=seq)
        elif isinstance(style, Rowwise):
            styles[name] = RowwiseParallel(output_layouts=seq)
        elif isinstance(style, VocabHead):
            styles[name] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    for whole_id, (shape, split) in splits.items():
        for name in names_of.get(whole_id, []):
            layout.add(name, shape, split)
    ties = [names for names in names_of.values() if len(names) > 1]
    parallelize_module(module, device_mesh, styles)
    _retie(module, ties)
    _localize(module)
    return LossParallel() if any(isinstance(s, VocabHead) for s in plan.values()) else CrossEntropy()


def _names_by_parameter(module: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


@torch.no_grad()
def _interleave_chunks(linear: nn.Module, chunks: int, tp: int) -> None:
    """Reorder a fused weight's rows (and bias) so row block r is rank r's piece of every chunk (q_r, k_r, v_r)."""
    for p in (linear.weight, getattr(linear, "bias", None)):
        if p is not None:
            split = Split(0, chunks)
            p.copy_(torch.cat([shard(p, split, tp, r) for r in range(tp)]))


def _retie(module: nn.Module, ties: list[list[str]]) -> None:
    """parallelize_module distributes each module's parameters apart: put one back under every tied name."""
    for names in ties:
        first = module.get_parameter(names[0])
        for name in names[1:]:
            parent, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, attr, first)


def _localize(module: nn.Module) -> None:
    """Keep each DTensor parameter as its local tensor (one per tied parameter); each forward of its module
    holds a DTensor view of it (`from_local`, whose backward returns the local gradient)."""
    from torch.distributed.tensor import DTensor

    local_of: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        specs = {}
        for name, p in list(mod._parameters.items()):
            if isinstance(p, DTensor):
                if id(p) not in local_of:
                    local_of[id(p)] = nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
                specs[name] = (p.device_mesh, tuple(p.placements), p.shape, p.stride())
                mod._parameters[name] = local_of[id(p)]
        if specs:
            in_forward(mod, {name: _as_dtensor(*spec) for name, spec in specs.items()})


def _as_dtensor(mesh, placements, shape, stride):
    from torch.distributed.tensor import DTensor

    return lambda local: DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
