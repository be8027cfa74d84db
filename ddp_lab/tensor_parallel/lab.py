"""`parallel.tp_impl=lab`: a model's TP plan applied with the lab's own layers (layers.py), in place.

Each module the plan names is replaced by its tensor-parallel layer (or given its hooks: a norm under sequence
parallelism, a module whose input is prepared once), holding this rank's piece of the weights. A weight tied
between two layers (an embedding and its output head, both split by vocabulary) stays one parameter: both
layers take the same piece. Every split parameter is recorded in the `TPLayout` under each of its names.
"""

from __future__ import annotations

from torch import nn

from ddp_lab.spec.parallel import (
    PrepareInput,
    Rowwise,
    SequenceNorm,
    Style,
    VocabEmbedding,
    VocabHead,
    padded_vocab,
)
from ddp_lab.tensor_parallel.comm import TPContext
from ddp_lab.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    prepare_input,
    sum_weight_gradients,
)
from ddp_lab.tensor_parallel.layout import Split, TPLayout
from ddp_lab.tensor_parallel.loss import CrossEntropy, VocabParallelCrossEntropy


def parallelize(module: nn.Module, plan: dict[str, Style], tp: TPContext, layout: TPLayout) -> CrossEntropy:
    """Apply `plan` to `module` in place; the loss its output takes (vocab-parallel when the head is split)."""
    prepared = [name for name, style in plan.items() if isinstance(style, PrepareInput)]
    pieces: dict[int, tuple[nn.Parameter, tuple, Split]] = {}  # id(whole weight) -> (piece, whole shape, split)
    loss: CrossEntropy = CrossEntropy()
    for name, style in plan.items():
        old = module.get_submodule(name)
        if isinstance(style, PrepareInput):
            prepare_input(old, tp)
            continue
        if isinstance(style, SequenceNorm):
            if tp.sequence_parallel:
                sum_weight_gradients(old, tp)
            continue
        new = _parallel_layer(old, style, tp, pieces, own_input=not any(name.startswith(p + ".") for p in prepared))
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child, new)
        if isinstance(style, VocabHead):
            rows = new.weight.shape[0]
            start = tp.rank * rows
            loss = VocabParallelCrossEntropy(tp, start, max(0, min(rows, old.weight.shape[0] - start)))
    split_of = {id(piece): (shape, split) for piece, shape, split in pieces.values()}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in split_of:
            layout.add(name, *split_of[id(p)])
    return loss


def _parallel_layer(old: nn.Module, style: Style, tp: TPContext, pieces: dict, own_input: bool) -> nn.Module:
    """The TP layer standing in for `old`, its weight's piece shared with a layer it is tied to."""
    if isinstance(style, Rowwise):
        new = RowParallelLinear(old, tp)
        pieces[id(old.weight)] = (new.weight, tuple(old.weight.shape), Split(1))
        return new
    vocab = isinstance(style, (VocabEmbedding, VocabHead))
    split = Split(0, padded=padded_vocab(old.weight.shape[0], tp.size)) if vocab else Split(0, style.chunks)
    tied = pieces.get(id(old.weight))
    if tied is not None and tied[2] != split:
        raise ValueError(f"tensor-parallel plan: a weight tied between two layers is split two ways ({tied[2]} and "
                         f"{split}): tie only layers split alike (an embedding and its output head)")
    weight = tied[0] if tied is not None else None
    if isinstance(style, VocabEmbedding):
        new = VocabParallelEmbedding(old, tp, split, weight)
    else:
        new = ColumnParallelLinear(old, tp, split, own_input or isinstance(style, VocabHead), weight)
        if new.bias is not None:
            pieces[id(old.bias)] = (new.bias, tuple(old.bias.shape), Split(0, split.chunks, split.padded))
    pieces[id(old.weight)] = (new.weight, tuple(old.weight.shape), split)
    return new
