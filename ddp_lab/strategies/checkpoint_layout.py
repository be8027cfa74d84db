"""Where a strategy keeps each piece of the model and its optimizer state, in one vocabulary every layout
shares: a parameter's name, the offset of a piece in its flattened full tensor, and a 1-D view of the live
values. rank/checkpoint.py saves the pieces where they are (torch.distributed.checkpoint, each rank its
own) and loads any layout's checkpoint into any other's pieces: resharding is DCP's overlap arithmetic.

`Pieces` is what `DataParallelBase.checkpoint_params()` returns; `optimizer_pieces` finds, for each tensor
a (possibly inner, sharded) optimizer updates, the parameter and offset it is a piece of. A tensor that is
a slice of a parameter's storage (zero2's shards) is found by its storage offset, a DTensor (torch's FSDP2
and replicate) by its placement.
"""

from __future__ import annotations

import math

import torch
from torch import nn

Piece = tuple[int, torch.Tensor]          # (offset in the flattened full tensor, 1-D view of live values)
Pieces = dict[str, tuple[tuple[int, ...], list[Piece]]]   # name -> (full shape, this rank's pieces)


def flat_piece(tensor: torch.Tensor) -> Piece | None:
    """A whole tensor, or a DTensor's local shard, as a piece of its full tensor; None where this rank holds
    none of it."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = tensor.to_local()
        _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        if any(offsets[1:]):
            raise NotImplementedError("a DTensor sharded on another dimension than rows")
        offset = offsets[0] * math.prod(tensor.shape[1:]) if offsets else 0
        return (offset, local.detach().reshape(-1)) if local.numel() else None
    return (0, tensor.detach().reshape(-1)) if tensor.numel() else None


def whole_parameters(module: nn.Module) -> Pieces:
    """Every parameter of `module` as this rank holds it: whole where replicated, its shard where a DTensor."""
    out = {}
    for name, p in module.named_parameters():
        piece = flat_piece(p)
        out[name] = (tuple(p.shape), [piece] if piece is not None else [])
    return out


def optimizer_pieces(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[int, tuple[str, int]]:
    """For each tensor `optimizer` updates (by id): the name of the parameter of `module` it is, or is a slice
    of, and its offset in that parameter's flattened full tensor."""
    from torch.distributed.tensor import DTensor

    named = list(module.named_parameters())
    by_id = {id(p): name for name, p in named}
    out = {}
    for group in optimizer.param_groups:
        for t in group["params"]:
            if id(t) in by_id:
                piece = flat_piece(t) if isinstance(t, DTensor) else (0, t)
                out[id(t)] = (by_id[id(t)], piece[0] if piece is not None else 0)
                continue
            for name, p in named:  # a slice of a parameter's storage (zero2's shard of its bucket)
                if t.untyped_storage().data_ptr() != p.untyped_storage().data_ptr() or not p.is_contiguous():
                    continue
                offset = t.storage_offset() - p.storage_offset()
                if 0 <= offset and offset + t.numel() <= p.numel():
                    out[id(t)] = (name, offset)
                    break
            else:
                raise ValueError(f"the optimizer updates a tensor of shape {tuple(t.shape)} that is no parameter's "
                                 "piece: the strategy must say where it lies (checkpoint_optimizer)")
    return out


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    """A state tensor's local values, flattened (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().reshape(-1)
