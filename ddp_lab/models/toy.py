"""A small MLP over token embeddings: next-token prediction without attention."""

import torch
from torch import nn


class ToyMLP(nn.Module):
    """Embedding -> num_layers x (Linear, GELU) -> untied output projection.

    Takes the same token batches and loss as the Transformer, so every strategy and test can swap
    one model for the other.
    """

    def __init__(self, vocab_size: int, context_length: int, d_model: int, d_ff: int, num_layers: int):
        super().__init__()
        self.context_length = context_length
        self.embed = nn.Embedding(vocab_size, d_model)
        layers = []
        for _ in range(num_layers):
            layers += [nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model)]
        self.mlp = nn.Sequential(*layers)
        self.out = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.mlp(self.embed(tokens)))
