"""`strategy=demo`: DeMo, decoupled momentum (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870).

No gradient is all-reduced. Each rank keeps its own momentum of its own gradients, sends only the few
largest DCT coefficients of it, keeps the rest, and every rank steps on the sign of what all of them
sent. Per trainable parameter and step (the authors' `bloc97/DeMo:demo.py`, written again here):

1. momentum  m ← decay · m + g  (this rank's gradient, unaveraged);
2. encode    the DCT-II (orthonormal) of m in chunks: a matrix in `chunk x chunk` blocks (each side the
   largest divisor of the dimension not above `chunk`, the reference's `_get_smaller_split`), a vector
   in runs of `chunk`; keep the `topk` coefficients of largest magnitude of each block;
3. forget    m ← m - IDCT(those coefficients): what was sent leaves the momentum (the rest stays and
   grows: the "decoupling");
4. gather    every rank's (index, value) pairs, one all-gather for the whole model;
5. decode    at each coefficient the mean of the values of the ranks that sent it (the reference's
   `scatter_reduce(mean, include_self=False)`), IDCT;
6. step      θ ← θ (1 - lr·wd) - lr · sign(decoded): sign-SGD with decoupled weight decay (torch's SGD
   with `weight_decay`, no momentum: for plain SGD coupled and decoupled decay are the same update).

Steps 1-5 run in `finish_gradient_synchronization()` (the sync phase; the DCT arithmetic is timed as
`compress_ms`, the gather as comm), and leave sign(decoded) in `.grad`; step 6 is the optimizer
`make_optimizer` returns, torch's SGD, whatever optimizer class it is handed: DeMo *is* its optimizer
(its spec refuses `train.optimizer=muon` and says so).

Differences from the reference, each on purpose: the momentum is kept in gradient units (the reference
adds lr·g: with a constant learning rate every step and the sign are the same, up to rounding); indices
travel as int16 (a block has at most 32,768 coefficients: `chunk` <= 181), not int64, so a pair is 6
bytes, not 12; and the whole model's pairs go in one all-gather instead of two per parameter.

What it reduces to with every coefficient kept (`topk >= chunk²`): every rank sends all of m, so the
decoded value is the rank mean of IDCT(DCT(m_r)) = mean_r m_r, and what is left of m is the DCT round
trip's rounding (~1e-7 of m), so m = g each step: the update is θ(1 - lr·wd) - lr·sign(mean_r g_r),
sign-SGD on the data-parallel gradient with decoupled weight decay (tests/parity/test_demo.py holds it
against that, computed by hand on one process over the whole batch).

Bytes: a rank sends `topk` (value fp32, index int16) pairs per block: `facts()["demo"]` has
`bytes_sent_per_step`, and `compression` = the fp32 gradient's bytes (what bucketed all-reduces) over
that. `comm_bytes` counts what is handed to the all-gather, its gathered output (as fsdp's all-gathers
count), world_size times the bytes sent.

Memory (`kept_tensors`): the momentum (one fp32 copy of the trainable parameters) and the DCT bases.
The gather's buffers live only during the sync. Checkpoints save each rank's momentum as its own state.
fp16's loss scaling is refused (its spec): a scaled, possibly infinite gradient would enter the momentum
for good; bf16 autocast is fine.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddp_lab.strategies.base import DataParallelBase
from ddp_lab.strategies.collectives import all_gather
from ddp_lab.units import tensor_bytes

VALUE, INDEX = torch.float32, torch.int16
PAIR_BYTES = 4 + 2


def largest_divisor_at_most(n: int, most: int) -> int:
    """The chunk side of a dimension of size n: its largest divisor not above `most` (the reference's
    `_get_smaller_split`, which also returns n when n is below `most`)."""
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


def dct_basis(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix D (n x n): coefficients = D @ x, and x = D.T @ coefficients."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    basis = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    basis[0] /= math.sqrt(2.0)
    return basis.float()


class Blocks:
    """One parameter's DCT blocks: its shape split into chunks, the encode and decode, its top-k."""

    def __init__(self, shape: torch.Size, chunk: int, topk: int, bases: dict[int, torch.Tensor] | None):
        """`bases`: the DCT bases by side, shared between parameters (filled here); None: no transform, the blocks'
        own values (SparseLoCo's chunking)."""
        self.shape = shape
        dims = list(shape) if len(shape) in (1, 2) else [math.prod(shape)]  # a scalar or >2-D: one long vector
        self.sides = [largest_divisor_at_most(n, chunk) for n in dims]
        self.dims = dims
        self.dct = bases is not None
        for side in self.sides if self.dct else []:
            bases.setdefault(side, dct_basis(side))
        self.bases = [bases[side] for side in self.sides] if self.dct else []
        self.per_block = math.prod(self.sides)
        self.count = math.prod(n // s for n, s in zip(dims, self.sides))
        self.k = min(topk, self.per_block)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(blocks, per_block) DCT coefficients of x (without bases: its values, block by block)."""
        if len(self.dims) == 2 and not self.dct:
            (h, w) = self.sides
            blocks = x.reshape(self.dims[0] // h, h, self.dims[1] // w, w).permute(0, 2, 1, 3)
            return blocks.reshape(self.count, self.per_block)
        if not self.dct:
            return x.reshape(self.count, self.per_block)
        if len(self.dims) == 2:
            (h, w), (dh, dw) = self.sides, self.bases
            blocks = x.reshape(self.dims[0] // h, h, self.dims[1] // w, w)
            return torch.einsum("yhxw,ah,bw->yxab", blocks, dh, dw).reshape(self.count, self.per_block)
        return (x.reshape(self.count, self.sides[0]) @ self.bases[0].T)

    def decode(self, coefficients: torch.Tensor) -> torch.Tensor:
        """The tensor (of the parameter's shape) whose coefficients these are."""
        if len(self.dims) == 2 and not self.dct:
            (h, w) = self.sides
            blocks = coefficients.reshape(self.dims[0] // h, self.dims[1] // w, h, w).permute(0, 2, 1, 3)
            return blocks.reshape(self.shape)
        if not self.dct:
            return coefficients.reshape(self.shape)
        if len(self.dims) == 2:
            (h, w), (dh, dw) = self.sides, self.bases
            blocks = coefficients.reshape(self.dims[0] // h, self.dims[1] // w, h, w)
            return torch.einsum("yxab,ah,bw->yhxw", blocks, dh, dw).reshape(self.shape)
        return (coefficients @ self.bases[0]).reshape(self.shape)

    def top(self, coefficients: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The k largest-magnitude coefficients of each block: (indices, values), each (blocks, k)."""
        index = torch.topk(coefficients.abs(), self.k, dim=-1, sorted=False).indices
        return index, coefficients.gather(-1, index)

    def place(self, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """(blocks, per_block) coefficients: `values` at `index` (one per place), 0 elsewhere: what was sent."""
        out = torch.zeros(self.count, self.per_block, dtype=values.dtype, device=values.device)
        return out.scatter_(-1, index, values)

    def scatter_mean(self, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """(blocks, per_block) coefficients: at each index the mean of the values sent for it, else 0."""
        out = torch.zeros(self.count, self.per_block, dtype=values.dtype, device=values.device)
        return out.scatter_reduce_(-1, index, values, reduce="mean", include_self=False)


class DeMo(DataParallelBase):
    """DeMo behind the strategy contract (module docstring): `DeMo(module, topk=32, chunk=64, decay=0.999)`."""

    def __init__(self, module: nn.Module, topk: int = 32, chunk: int = 64, decay: float = 0.999, process_group=None):
        if not (isinstance(chunk, int) and 1 <= chunk and chunk * chunk <= torch.iinfo(INDEX).max + 1):
            raise ValueError(f"chunk must be an integer in [1, 181] (a block's indices travel as int16), got {chunk!r}")
        if not (isinstance(topk, int) and 1 <= topk <= chunk * chunk):
            raise ValueError(f"topk must be an integer in [1, chunk² = {chunk * chunk}], got {topk!r}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        super().__init__(module, process_group=process_group)
        self.topk, self.chunk, self.decay = topk, chunk, float(decay)
        self._params = self.trainable_parameters()
        self._bases: dict[int, torch.Tensor] = {}
        self._blocks = [Blocks(p.shape, chunk, topk, self._bases) for p in self._params]
        device = self._params[0].device if self._params else torch.device("cpu")
        self._bases.update({side: basis.to(device) for side, basis in self._bases.items()})
        for blocks in self._blocks:
            blocks.bases = [self._bases[side] for side in blocks.sides]
        self.momentum = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in self._params]
        self.pairs = sum(b.count * b.k for b in self._blocks)  # (index, value) pairs a rank sends per step

    def make_optimizer(self, optimizer_cls, params=None, lr: float = 1e-3, weight_decay: float = 0.0,
                       **kwargs) -> torch.optim.Optimizer:
        """torch's SGD (no momentum) over the parameters, whatever `optimizer_cls` is: it steps on the sign
        `finish_gradient_synchronization` leaves in `.grad` (module docstring, step 6)."""
        return torch.optim.SGD(self._params if params is None else params, lr=lr, weight_decay=weight_decay)

    def kept_tensors(self) -> list[torch.Tensor]:
        """This rank's momentum (what it has not sent) and the DCT bases."""
        return self.momentum + list(self._bases.values())

    def facts(self) -> dict:
        sent = self.pairs * PAIR_BYTES
        fp32 = sum(p.numel() * 4 for p in self._params)
        return {"demo": {"topk": self.topk, "chunk": self.chunk, "decay": self.decay, "bytes_sent_per_step": sent,
                         "fp32_gradient_bytes": fp32, "compression": round(fp32 / sent, 2) if sent else None}}

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if not self._params:
            return
        with self.comm.exposed():
            with self.comm.arithmetic():
                payload = self._encode()
            world = self.dp_size
            gathered = torch.empty(world * payload.numel(), dtype=payload.dtype, device=payload.device)
            with self.comm.timed(tensor_bytes(gathered)):
                all_gather(gathered, payload, group=self.process_group)
            with self.comm.arithmetic():
                self._decode(gathered.view(world, -1))

    def _encode(self) -> torch.Tensor:
        """Steps 1-3 for every parameter; this rank's pairs as one byte buffer: every value, then every index."""
        values, indices = [], []
        for p, m, blocks in zip(self._params, self.momentum, self._blocks):
            m.mul_(self.decay)
            if p.grad is not None:  # an unused parameter adds nothing to its momentum this step
                m.add_(p.grad)
            index, value = blocks.top(blocks.encode(m))
            m.sub_(blocks.decode(blocks.place(index, value)))
            values.append(value.reshape(-1))
            indices.append(index.reshape(-1).to(INDEX))
        return torch.cat([torch.cat(values).to(VALUE).view(torch.uint8), torch.cat(indices).view(torch.uint8)])

    def _decode(self, gathered: torch.Tensor) -> None:
        """Steps 4-5: every rank's pairs, per parameter the scatter-mean decoded, its sign into `.grad`."""
        world = gathered.shape[0]
        values = gathered[:, :self.pairs * 4].contiguous().view(VALUE)  # (world, pairs)
        indices = gathered[:, self.pairs * 4:].contiguous().view(INDEX).long()
        start = 0
        for p, blocks in zip(self._params, self._blocks):
            n = blocks.count * blocks.k
            index = indices[:, start:start + n].reshape(world, blocks.count, blocks.k).permute(1, 0, 2)
            value = values[:, start:start + n].reshape(world, blocks.count, blocks.k).permute(1, 0, 2)
            start += n
            decoded = blocks.decode(blocks.scatter_mean(index.reshape(blocks.count, -1),
                                                        value.reshape(blocks.count, -1).to(p.dtype)))
            p.grad = decoded.sign_()

    def checkpoint_rank_state(self) -> dict[str, torch.Tensor]:
        """This rank's momentum: what it has not sent yet, its own."""
        return {"demo.momentum": _flatten_dense_tensors(self.momentum)} if self.momentum else {}

    @torch.no_grad()
    def load_rank_state(self, state: dict[str, torch.Tensor]) -> bool:
        """The momentum as this rank saved it where it fits; else zeros (what it starts from)."""
        saved = state.get("demo.momentum")
        fits = saved is not None and saved.numel() == sum(m.numel() for m in self.momentum)
        for m, mine in zip(self.momentum, _unflatten_dense_tensors(saved, self.momentum) if fits else
                           [torch.zeros_like(m) for m in self.momentum]):
            m.copy_(mine)
        return fits
