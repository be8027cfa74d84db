"""Where each element of a tensor-parallel parameter lies: the one split every TP piece is cut by, and its way
back to the single-process layout.

A `Split` says how one parameter is cut over the TP ranks: along a dimension, chunk by chunk for a fused
projection (q, k, v: each rank takes its slice of every chunk), the vocabulary padded to a multiple of tp
for the lab's layers (torch's DTensor cuts it unevenly, as `torch.chunk` does). `shard()` cuts a tensor so;
the lab's layers cut their weights with it, torch's plan orders a fused weight with it before DTensor cuts
it, and `index_map()` cuts `arange` the same way: each local element's place in the whole tensor (-1 for
padding). From that map, `TPLayout` gathers whole parameters (`train.save_model`, the parity proofs) and
turns a strategy's checkpoint pieces of a local shard into pieces of the whole parameter, so a checkpoint
holds the single-process layout whatever the mesh that wrote it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Split:
    """How one parameter is cut over `tp` ranks."""

    dim: int
    """The dimension cut: 0 for rows (column-parallel weights, vocabulary rows), 1 for columns (row-parallel)."""
    chunks: int = 1
    """A fused weight's equal blocks along `dim`, each cut alike (q, k and v)."""
    padded: int | None = None
    """The size of `dim` after padding with rows no token uses (the lab's vocabulary); None: no padding."""


def shard(full: torch.Tensor, split: Split, tp: int, rank: int, fill=0) -> torch.Tensor:
    """This rank's piece of `full` (a copy), cut as `split` says; padding filled with `fill`."""
    if split.padded is not None and split.padded > full.shape[split.dim]:
        pad = list(full.shape)
        pad[split.dim] = split.padded - full.shape[split.dim]
        full = torch.cat([full, torch.full(pad, fill, dtype=full.dtype, device=full.device)], dim=split.dim)
    blocks = full.chunk(split.chunks, dim=split.dim) if split.chunks > 1 else (full,)
    pieces = []
    for block in blocks:
        parts = block.chunk(tp, dim=split.dim)
        pieces.append(parts[rank] if rank < len(parts) else block.narrow(split.dim, 0, 0))
    return torch.cat(pieces, dim=split.dim)


def index_map(shape: tuple[int, ...], split: Split, tp: int, rank: int) -> torch.Tensor:
    """For each element of this rank's piece (flattened), its index in the whole tensor flattened; -1: padding."""
    numel = math.prod(shape)
    return shard(torch.arange(numel, dtype=torch.int64).view(shape), split, tp, rank, fill=-1).reshape(-1)


def runs(indices: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start in `indices`, end, first whole-tensor index) of each maximal run of consecutive indices, padding
    (-1) left out: the contiguous pieces of the whole tensor a local slice is made of."""
    if indices.numel() == 0:
        return []
    valid = indices >= 0
    breaks = torch.ones(indices.numel(), dtype=torch.bool)
    breaks[1:] = (indices[1:] != indices[:-1] + 1) | (valid[1:] != valid[:-1])
    starts = breaks.nonzero().flatten().tolist() + [indices.numel()]
    return [(a, b, int(indices[a])) for a, b in zip(starts[:-1], starts[1:]) if valid[a]]


class TPLayout:
    """Every split parameter of a tensor-parallel model, by name (tied ones under each name), with its whole
    shape: gathers them whole and places checkpoint pieces in the whole tensors."""

    def __init__(self, group, tp: int, rank: int):
        self.group, self.tp, self.rank = group, tp, rank
        self.splits: dict[str, Split] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._maps: dict[str, torch.Tensor] = {}

    def add(self, name: str, shape: tuple[int, ...], split: Split) -> None:
        self.splits[name], self.shapes[name] = split, tuple(shape)

    def indices(self, name: str) -> torch.Tensor:
        if name not in self._maps:
            self._maps[name] = index_map(self.shapes[name], self.splits[name], self.tp, self.rank)
        return self._maps[name]

    def whole(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state dict of local pieces (every split parameter as this rank holds it, whole over the data axis) in
        the single-process layout: each split one summed over the TP ranks from the pieces placed in zeros
        (each element comes from one rank: exact). Collective over the TP group: every TP rank calls it."""
        out = {}
        for name, local in state.items():
            if name not in self.splits:
                out[name] = local
                continue
            where = self.indices(name)
            keep = where >= 0
            full = torch.zeros(math.prod(self.shapes[name]), dtype=local.dtype, device=local.device)
            full[where[keep].to(local.device)] = local.reshape(-1)[keep.to(local.device)]
            dist.all_reduce(full, group=self.group)
            out[name] = full.view(self.shapes[name])
        return out

    def pieces(self, name: str, shape, local_pieces: list) -> tuple[str, tuple[int, ...], list]:
        """A strategy's checkpoint pieces of this rank's tensor `name` of `shape` ((offset in it flattened, 1-D
        view)) as pieces of the whole parameter, with its name and whole shape (rank/checkpoint.py's `place`); a
        parameter not split as it is."""
        if name not in self.splits:
            return name, shape, local_pieces
        where, out = self.indices(name), []
        for offset, view in local_pieces:
            for a, b, first in runs(where[offset:offset + view.numel()]):
                out.append((first, view[a:b]))
        return name, self.shapes[name], out
