"""`train.activation_checkpointing`: recompute instead of keeping activations, block by block (the planner's memory
lever, docs/plan.md).

- `full`: each Transformer block keeps only its input; backward runs its forward again (torch.utils.checkpoint,
  non-reentrant) before its own backward.
- `selective`: each block keeps its matmuls' outputs (aten.mm, addmm, bmm) and recomputes everything else, the norms,
  the rotary embedding, the attention kernel and the activation function (torch's selective checkpoint contexts, the
  op-level policy torchtitan applies; the FLOPs recomputed are attention's, as the planner prices them).

Applied to the model's blocks after the mesh has cut them (a rank's tensor-parallel pieces, its pipeline stages,
its context-parallel attention) and before the strategy wraps it, as torchtitan applies its checkpoint wrapper before
`fully_shard`, so a strategy's per-block hooks see the block as before. Recomputation replays the same operations on
the same inputs, collectives included (a block's tensor-parallel all-reduces but its last, context parallelism's
exchange): the trained weights are bit for bit those without it on every axis
(tests/parity/test_activation_checkpointing.py, test_activation_checkpointing_mesh.py).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")
KEPT = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
"""What `selective` keeps: the matmuls' outputs."""


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in KEPT else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward, mode: str, *args, **kwargs):
    context = {"context_fn": partial(create_selective_checkpoint_contexts, _selective_policy)} \
        if mode == "selective" else {}
    return checkpoint(forward, *args, use_reentrant=False, **context, **kwargs)


def blocks_of(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks checkpointing applies to: a model's `blocks` (the lab's Transformer), else none."""
    blocks = getattr(module, "blocks", None)
    return list(blocks) if isinstance(blocks, nn.ModuleList) else []


def apply_activation_checkpointing(module: nn.Module, mode: str) -> int:
    """Checkpoint every block of `module` in `mode` (MODES), in place; returns how many blocks."""
    if mode not in MODES:
        raise ValueError(f"train.activation_checkpointing must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none":
        return 0
    blocks = blocks_of(module)
    for block in blocks:
        block.forward = partial(_checkpointed, block.forward, mode)
    return len(blocks)


def counted_peak(mode: str, peak: int | None) -> int | None:
    """The census's activation peak as the summary may state it: under `selective`, None (not counted), never an
    under-count: torch's selective contexts keep the matmuls' outputs outside the saved-tensor hooks it reads."""
    return None if mode == "selective" else peak
