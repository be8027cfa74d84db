"""A model cut into pipeline stages: this rank keeps its stages' layers and runs one stage at a time.

A model says how it runs as a chain with `pp_layers()`: (the layers before its blocks, each block's layers, the
layers after), module names in the order its forward applies them, each taking the previous one's output (the
Transformer: `embed`; `blocks.i`; `ln_final`, `lm_head`). The blocks are split into stages (spec/pipeline.py's
`split_blocks`), the first layers go with the first stage, the last with the last. A rank keeps the model object
with every other stage's layers replaced by `nn.Identity` (no parameters), so its parameters keep the names one
process gives them (checkpoints, the whole state, the optimizer's and the strategies' bookkeeping), and its
forward becomes `forward(x, chunk=k)`: the layers of its k-th stage, in order.

A weight tied between layers on two stages (an embedding and its output head) is a copy on each: both start
equal (every rank takes pipeline rank 0's whole model first) and their gradients are summed over the two stages
after each step's backward, as Megatron sums its embedding group's (`TiedAcrossStages`).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.spec.pipeline import balanced_counts, split_blocks, stage_index


def chain_of(module: nn.Module) -> tuple[list[str], list[list[str]], list[str]]:
    """The model's `pp_layers()`; ValueError (one line) for a model without them."""
    if not hasattr(module, "pp_layers"):
        raise ValueError(f"{type(module).__name__} declares no pipeline layers (pp_layers(): docs/pipelines.md)")
    return module.pp_layers()


def flops_per_token(module: nn.Module, names: list[str]) -> float:
    """Forward FLOPs per token of the named layers: 2 per weight of their matmuls (every 2-D weight but an
    embedding's, which is a lookup), and attention's scores and weighted sum over the model's context (2 x context x
    d_model together, causal) for each layer holding one."""
    context, total = getattr(module, "context_length", 0), 0.0
    for name in names:
        layer = module.get_submodule(name)
        for sub in layer.modules():
            if isinstance(sub, nn.Embedding):
                continue
            total += sum(2 * p.numel() for p in sub.parameters(recurse=False) if p.dim() == 2)
            if type(sub).__name__.endswith("Attention") and hasattr(sub, "qkv"):
                total += 2 * context * sub.qkv.in_features
    return total


def flops_balanced(module: nn.Module, stages: int) -> list[int]:
    """`parallel.stage_layers=auto`: blocks per stage by their FLOPs, the first stage's embedding and the last
    stage's norm and head (and the loss over the vocabulary, 2 x vocab per token beside the head) counted."""
    first, blocks, last = chain_of(module)
    head = flops_per_token(module, last)
    vocab = next((p.shape[0] for name in last for p in module.get_submodule(name).parameters() if p.dim() == 2), 0)
    return balanced_counts([flops_per_token(module, b) for b in blocks], stages, flops_per_token(module, first),
                           head + 2 * vocab)


def stage_layers(module: nn.Module, stages: int, counts: list[int] | None = None) -> list[list[str]]:
    """Each stage's layer names, in the order they run."""
    first, blocks, last = chain_of(module)
    ranges = split_blocks(len(blocks), stages, counts)
    return [(first if s == 0 else []) + [name for b in ranges[s] for name in blocks[b]]
            + (last if s == stages - 1 else []) for s in range(stages)]


def keep_stages(module: nn.Module, pp: int, pp_rank: int, chunks: int, counts: list[int] | None = None
                ) -> list[list[str]]:
    """Cut `module` in place down to this rank's stages (module docstring); every stage's layer names."""
    layers = stage_layers(module, pp * chunks, counts)
    mine = [layers[stage_index(pp_rank, c, pp)] for c in range(chunks)]
    keep = {name for names in mine for name in names}
    for names in layers:
        for name in names:
            if name not in keep:
                parent, _, child = name.rpartition(".")
                setattr(module.get_submodule(parent) if parent else module, child, nn.Identity())
    module._pp_chunks = mine
    module.forward = types.MethodType(_stage_forward, module)
    return layers


def _stage_forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    for name in self._pp_chunks[chunk]:
        x = self.get_submodule(name)(x)
    return x


def stage_of(name: str, layers: list[list[str]]) -> int:
    """The stage a parameter (or layer) of the whole model lives on."""
    for s, names in enumerate(layers):
        if any(name == layer or name.startswith(layer + ".") for layer in names):
            return s
    raise ValueError(f"{name} is in none of the pipeline's layers (pp_layers() must list every parameter's layer)")


class TiedAcrossStages:
    """Weights tied between layers the pipeline put on different ranks: each copy's gradient becomes the sum of
    both (one all-reduce over the ranks holding them, for every dp and tp place), next to the strategy's
    gradient sync (`synchronize`)."""

    def __init__(self, module: nn.Module, ties: list[list[str]], layers: list[list[str]], layout, pp_rank: int):
        """`ties`: the names of each weight the whole model held under several names (parity.ties_of), taken
        before the model was cut; `layers`: every stage's layers. Collective: every rank builds the same groups."""
        self.pairs: list[tuple[str, object]] = []  # this rank's copy by name: a strategy may replace the object
        for names in ties:
            ranks = sorted({stage_of(n, layers) % layout.pp for n in names})
            if len(ranks) < 2:
                continue  # every copy on one rank: one parameter there, as in the whole model
            group, _ = dist.new_subgroups_by_enumeration(
                [[layout.rank_at(dp=i, tp=j, pp=k, cp=c) for k in ranks]
                 for i in range(layout.dp) for c in range(layout.cp) for j in range(layout.tp)])
            if pp_rank in ranks:
                name = next(n for n in names if stage_of(n, layers) % layout.pp == pp_rank)
                self.pairs.append((name, group))

    def sum_first(self, model) -> bool:
        """Whether the copies are summed before the strategy's sync (its last backward then runs under no_sync):
        where the strategy reduces after no_sync, its reduction carries the sum to wherever it keeps gradients
        (zero2 and DeepSpeed-like strategies keep only their shard after it). Otherwise (FSDP2's, which reduce in
        backward) the sum follows the sync, on each rank's local piece: both copies are sharded alike."""
        return bool(self.pairs) and model.reduces_after_no_sync

    def synchronize(self, model) -> None:
        """The strategy's gradient sync and the tied copies' sum, in the order `sum_first` says."""
        if self.sum_first(model):
            self._sum(model.module)
            model.finish_gradient_synchronization()
        else:
            model.finish_gradient_synchronization()
            self._sum(model.module)

    def _sum(self, module: nn.Module) -> None:
        for name, group in self.pairs:
            grad = module.get_parameter(name).grad
            if grad is not None:
                dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=group)
