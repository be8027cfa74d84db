"""A small MLP over token embeddings: next-token prediction without attention."""

import torch
from torch import nn

from ddp_lab.spec.parallel import Colwise, Rowwise, VocabEmbedding, VocabHead


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

    def pp_layers(self) -> tuple[list[str], list[list[str]], list[str]]:
        """The forward as a chain for pipeline parallelism: the embedding, each (Linear, GELU, Linear) pair as a
        block, the output."""
        return ["embed"], [[f"mlp.{i + k}" for k in range(3)] for i in range(0, len(self.mlp), 3)], ["out"]

    def tp_plan(self) -> dict:
        """Tensor parallelism's split (spec/parallel.py): each (Linear, GELU, Linear) pair as Megatron splits an
        MLP, the first column-wise, the second row-wise (its bias added once, after the sum); the embedding and
        the output by vocabulary."""
        plan = {"embed": VocabEmbedding()}
        for i in range(0, len(self.mlp), 3):
            plan.update({f"mlp.{i}": Colwise(what="model.d_ff"), f"mlp.{i + 2}": Rowwise(what="model.d_ff")})
        plan["out"] = VocabHead()
        return plan
