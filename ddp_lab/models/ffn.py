"""The course's communication-accounting model: feed-forward blocks only, activations in and out.

CS336's "XXL" (d_model 16384, d_ff 53248, 126 blocks) keeps only what holds nearly every FLOP of a very large
model: "we omit attention, input embeddings, and output linear layers ... each FFN is simply two linear
layers (ignoring the activation function)". So a block is two bias-free linears, d_model -> d_ff -> d_model,
and the model maps (batch, sequence, d_model) activations to activations: nothing to train on tokens, a
model to count (`python -m ddp_lab.calculator --model xxl_ffn`, on the meta device) and to split by tensor
parallelism's plan (Megatron's: w1 column-wise, w2 row-wise).
"""

import torch
from torch import nn

from ddp_lab.spec.parallel import Colwise, Rowwise


class FFNBlock(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.w1(x))


class FFNStack(nn.Module):
    """`num_layers` FFNBlocks; takes activations, not tokens (`example_input`)."""

    def __init__(self, vocab_size: int, context_length: int, d_model: int, d_ff: int, num_layers: int):
        super().__init__()
        self.context_length, self.d_model = context_length, d_model
        self.blocks = nn.ModuleList(FFNBlock(d_model, d_ff) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def example_input(self, batch: int, device="meta") -> torch.Tensor:
        """What a forward takes: (batch, context_length, d_model) activations (models/facts.py runs it)."""
        return torch.zeros(batch, self.context_length, self.d_model, device=device)

    def tp_plan(self) -> dict:
        """Megatron's split of each block: w1 column-wise, w2 row-wise (spec/parallel.py)."""
        plan = {}
        for i in range(len(self.blocks)):
            plan.update({f"blocks.{i}.w1": Colwise(what="model.d_ff"), f"blocks.{i}.w2": Rowwise(what="model.d_ff")})
        return plan
