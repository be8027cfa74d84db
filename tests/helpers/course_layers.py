"""Layer classes as the course's own (CS336 assignment 1's `Linear`, `Embedding`, `RMSNorm`), and an FSDP that picks
the layers it shards by `isinstance` on them, as the 2026 course's FSDP does: on the check's models it shards nothing
until `--layers` builds them of these classes (tests/e2e/test_check.py)."""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers.own_ddp import CastsOnlyItsLayers


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features, device=device, dtype=dtype)
                                   / in_features**0.5)

    def forward(self, x):
        return torch.einsum("...i,oi->...o", x, self.weight)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_embeddings, embedding_dim, device=device, dtype=dtype))

    def forward(self, token_ids):
        return self.weight[token_ids]


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x):
        in_dtype = x.dtype
        x = x.to(torch.float32)
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(in_dtype)


class IsinstanceFSDP(CastsOnlyItsLayers):
    """Right: shards the course's own Linear and Embedding (by isinstance), casts only them to compute_dtype."""

    def shards(self, layer: nn.Module) -> bool:
        return isinstance(layer, (Linear, Embedding))


class AveragesFrozenToo(IsinstanceFSDP):
    """The course's frozen bug: a frozen weight is gathered whole and given back, but its rows are replaced by a
    zero gradient's average step... here: it averages every parameter's data after backward, frozen ones
    included, each rank's shard rows as if they were the whole weight."""

    def finish_gradient_synchronization(self) -> None:
        super().finish_gradient_synchronization()
        for p in self.module.parameters():
            if not p.requires_grad:
                p.data.add_(0.01)  # a "refresh" of frozen weights it should never touch
