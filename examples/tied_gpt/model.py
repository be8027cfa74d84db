"""`model=tied_gpt`: a model written outside ddp_lab, GPT-2's shape at small sizes.

Learned position embeddings, pre-LayerNorm blocks (causal attention, a 4x GELU MLP, biases everywhere),
an output head tied to the token embedding (the weight GPT-2 shares between input and output), GPT-2's
initialisation, and a tensor-parallel plan (`tp_plan`: `parallel.tp=2` splits it as Megatron splits GPT-2). Any
`nn.Module` that maps a (batch, context) tensor of token ids to (batch, context, vocab) logits trains
here; its arguments are its YAML's keys (examples/conf/model/tied_gpt.yaml), and `vocab_size` and
`context_length` are the two every model takes (the data is drawn from them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.up, self.down = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head_dim = x.shape[-1] // self.num_heads  # the heads this rank computes: from qkv's width (its share under TP)
        q, k, v = self.qkv(self.ln1(x)).unflatten(-1, (3, -1, head_dim)).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).flatten(2))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TiedGPT(nn.Module):
    tp_sequence_parallel = False
    """Its plan does not run sequence parallel (tp_plan says why): launch.py refuses parallel.sequence_parallel=true."""

    def __init__(self, vocab_size: int, context_length: int, d_model: int, num_layers: int, num_heads: int):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.embed = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(context_length, d_model)
        self.blocks = nn.ModuleList(Block(d_model, num_heads) for _ in range(num_layers))
        self.ln_final = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, used by the lookup and the output matmul
        for module in self.modules():  # GPT-2's initialisation: N(0, 0.02) weights, zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x))

    def tp_plan(self) -> dict:
        """How `parallel.tp` splits it (ddp_lab/spec/parallel.py's styles, as a model of your own declares them):
        the tied embedding and head by vocabulary, q/k/v by heads and the MLP's up projection column-wise, the
        attention's output and the MLP's down projection row-wise (their biases added once). Not sequence
        parallel: the learned positions are added to the whole sequence, where sequence parallelism would hand
        the blocks a shard of it."""
        from ddp_lab.spec.parallel import Colwise, Rowwise, VocabEmbedding, VocabHead

        plan = {"embed": VocabEmbedding()}
        for i, block in enumerate(self.blocks):
            head_dim = block.qkv.in_features // block.num_heads
            plan.update({f"blocks.{i}.qkv": Colwise(chunks=3, unit=head_dim, what="model.num_heads"),
                         f"blocks.{i}.proj": Rowwise(what="model.num_heads"), f"blocks.{i}.up": Colwise(),
                         f"blocks.{i}.down": Rowwise()})
        return {**plan, "head": VocabHead()}
