"""SparseLoCo's outer compression (Sarfi et al. 2025, arXiv 2508.15706): local_sgd's `outer_topk`.

Instead of all-reducing the parameters at a sync, each rank sends a sparse, quantized pseudo-gradient, and keeps
what it did not send as error feedback. Per trainable parameter of the fragment, at each of its syncs:

1. error       e ← error_decay · e + Δ, with Δ = θ_anchor - θ (this rank's change since the last sync);
2. select      the `outer_topk` largest-magnitude values of each `outer_chunk` x `outer_chunk` block of e (a
               vector in runs of `outer_chunk`; each side the largest divisor not above it: DeMo's blocks, no
               DCT, as templar's `ChunkingTransformer` tiles them);
3. quantize    `outer_bits=2`: each kept value to one of 4 levels, ±1/3 and ±1 times the block's largest kept
               magnitude (a 2-bit code and one fp32 scale per block); `outer_bits=32`: sent as they are;
4. forget      e ← e - what was sent (dequantized): the rest waits for the next sync;
5. gather      every rank's (scale or value, int16 index, code) payload, one all-gather per fragment;
6. average     Δ̄ = (1/R) Σ_r of the ranks' sparse tensors (an index one rank did not send counts as 0 there);
7. step        θ_anchor ← θ_anchor - Δ̄, and the fragment takes it (mixed with its own by local_sgd's `mix`).

The outer step is plain (lr 1, no momentum): the error feedback takes the outer momentum's place, as in the
paper; local_sgd refuses `outer=nesterov` with it. Our quantizer is the simple uniform one above, said here
because the paper's may differ in its levels; its payload is counted exactly: per block, k int16 indices and
either k fp32 values or k 2-bit codes (4 to a byte) and an fp32 scale.

What it reduces to with every value sent unquantized (`outer_topk = outer_chunk²`, `outer_bits=32`): nothing
stays in e (chunking is exact), so e = Δ each sync, Δ̄ = the rank mean of Δ and the anchor becomes the rank
mean of θ: plain parameter averaging, local_sgd's `outer=none` (tests/parity/test_local_sgd.py holds it to
float rounding).
"""

from __future__ import annotations

import torch

from ddp_lab.strategies.demo import Blocks

INDEX = torch.int16
BITS = (2, 32)


def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks, k) values -> their 2-bit codes (uint8, 0..3), each block's scale, and what the codes stand for."""
    scale = values.abs().amax(dim=-1).clamp_min(torch.finfo(values.dtype).tiny)
    codes = torch.round((values / scale[:, None] + 1) * 1.5).clamp_(0, 3).to(torch.uint8)
    return codes, scale, dequantize(codes, scale)


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """2-bit codes 0..3 -> -1, -1/3, 1/3, 1 times their block's scale."""
    return (codes.float() / 1.5 - 1.0) * scale[..., None]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes (uint8, any length) four to a byte."""
    flat = torch.nn.functional.pad(codes.reshape(-1), (0, -codes.numel() % 4)).reshape(-1, 4)
    return flat[:, 0] | (flat[:, 1] << 2) | (flat[:, 2] << 4) | (flat[:, 3] << 6)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first n codes of `pack`'s bytes (the last dimension; leading dimensions kept)."""
    parts = torch.stack([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)
    return parts.reshape(*packed.shape[:-1], -1)[..., :n]


class SparseOuter:
    """One fragment's SparseLoCo state and payload (module docstring): `encode` at the sync, `decode` at landing."""

    def __init__(self, params: list[torch.Tensor], chunk: int, topk: int, bits: int, decay: float):
        self.blocks = [Blocks(p.shape, chunk, topk, None) for p in params]
        self.error = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in params]
        self.bits, self.decay = bits, decay
        self.pairs = sum(b.count * b.k for b in self.blocks)
        self.block_count = sum(b.count for b in self.blocks)
        floats = self.block_count if bits == 2 else self.pairs  # scales, or the values themselves
        self.payload_bytes = floats * 4 + self.pairs * 2 + (-(-self.pairs // 4) if bits == 2 else 0)

    @torch.no_grad()
    def encode(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        """Steps 1-4 on this rank's Δ per parameter; its payload (uint8: floats, then indices, then codes)."""
        floats, indices, codes = [], [], []
        for blocks, error, delta in zip(self.blocks, self.error, deltas):
            error.mul_(self.decay).add_(delta)
            index, value = blocks.top(blocks.encode(error))
            if self.bits == 2:
                code, scale, value = quantize(value)
                floats.append(scale)
                codes.append(code.reshape(-1))
            else:
                floats.append(value.reshape(-1))
            error.sub_(blocks.decode(blocks.place(index, value.to(error.dtype))))
            indices.append(index.reshape(-1).to(INDEX))
        parts = [torch.cat(floats).float().view(torch.uint8), torch.cat(indices).view(torch.uint8)]
        if codes:
            parts.append(pack(torch.cat(codes)))
        return torch.cat(parts)

    @torch.no_grad()
    def decode(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        """Steps 6: every rank's payload (world, payload_bytes) -> Δ̄ per parameter."""
        world = gathered.shape[0]
        floats = self.block_count if self.bits == 2 else self.pairs
        at = floats * 4
        scales_or_values = gathered[:, :at].contiguous().view(torch.float32)
        indices = gathered[:, at:at + self.pairs * 2].contiguous().view(INDEX).long()
        codes = unpack(gathered[:, at + self.pairs * 2:], self.pairs) if self.bits == 2 else None
        out, pair, block = [], 0, 0
        for blocks, error in zip(self.blocks, self.error):
            n = blocks.count * blocks.k
            index = indices[:, pair:pair + n].reshape(world, blocks.count, blocks.k)
            if codes is not None:
                value = dequantize(codes[:, pair:pair + n].reshape(world, blocks.count, blocks.k),
                                   scales_or_values[:, block:block + blocks.count])
            else:
                value = scales_or_values[:, pair:pair + n].reshape(world, blocks.count, blocks.k)
            summed = torch.zeros(blocks.count, blocks.per_block, dtype=error.dtype, device=error.device)
            for r in range(world):  # a sum over ranks, then / R: an index a rank did not send is 0 there
                summed.scatter_add_(-1, index[r], value[r].to(error.dtype))
            out.append(blocks.decode(summed / world))
            pair, block = pair + n, block + blocks.count
        return out


def gathered_buffer(payload: torch.Tensor, ranks: int) -> torch.Tensor:
    """The all-gather's output for a payload: every one of `ranks` ranks', in rank order."""
    return torch.empty(ranks * payload.numel(), dtype=payload.dtype, device=payload.device)
