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
from itertools import count

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ddp_lab.models.recomputing import ONCE_A_FORWARD, told_apart
from ddp_lab.rank.activations import kept_outside_hooks

MODES = ("none", "full", "selective")
KEPT = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
"""What `selective` keeps: the matmuls' outputs."""


_kept = count()  # a key for each output selective keeps: fresh tensors, each its own storage


def _output_bytes(op, args) -> int:
    """The bytes of a kept matmul's output, from its inputs' shapes (the policy runs before the op)."""
    a, b = (args[1], args[2]) if op is torch.ops.aten.addmm.default else (args[0], args[1])
    rows = a.shape[0] * a.shape[1] if op is torch.ops.aten.bmm.default else a.shape[0]
    return rows * b.shape[-1] * a.element_size()


def _selective_policy(ctx, op, *args, **kwargs):
    if op not in KEPT:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute:  # kept until the block's backward: counted by the census
        kept_outside_hooks(("selective", next(_kept)), _output_bytes(op, args))
    return CheckpointPolicy.MUST_SAVE


def _checkpointed(forward, mode: str, once: bool, *args, **kwargs):
    """`forward` under torch's checkpoint (the inputs it keeps for the recompute are saved under the census's hooks:
    counted there); `once`: its recompute told apart (models/recomputing.py)."""
    context = {"context_fn": partial(create_selective_checkpoint_contexts, _selective_policy)} \
        if mode == "selective" else {}
    return checkpoint(told_apart(forward) if once else forward, *args, use_reentrant=False, **context, **kwargs)


def blocks_of(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks checkpointing applies to: a model's `blocks` (the lab's Transformer), else none."""
    blocks = getattr(module, "blocks", None)
    return list(blocks) if isinstance(blocks, nn.ModuleList) else []


def recomputes(module: nn.Module) -> bool:
    """Whether any block of `module` runs under checkpointing (`apply_activation_checkpointing`): its backward
    recomputes the block's forward, once per backward call."""
    return any(getattr(block.forward, "func", None) is _checkpointed for block in blocks_of(module))


def apply_activation_checkpointing(module: nn.Module, mode: str) -> int:
    """Checkpoint every block of `module` in `mode` (MODES), in place; returns how many blocks."""
    if mode not in MODES:
        raise ValueError(f"train.activation_checkpointing must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none":
        return 0
    blocks = blocks_of(module)
    for block in blocks:
        once = any(getattr(layer, ONCE_A_FORWARD, False) for layer in block.modules())
        block.forward = partial(_checkpointed, block.forward, mode, once)
    return len(blocks)
