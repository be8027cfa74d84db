"""The CS336 assignment's pre-norm decoder-only Transformer.

RMSNorm, causal multi-head self-attention with rotary position embeddings (RoPE), SwiGLU
feed-forward, untied output projection. Sizes come from `conf/model/*.yaml` (Table 1).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from ddp_lab.spec.parallel import Colwise, PrepareInput, Rowwise, SequenceNorm, VocabEmbedding, VocabHead


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In fp32, and in the input's dtype out (as the course's RMSNorm): an fp16 input stays fp16 whatever the
        weight's dtype, so the next layer's fp16 matmul gets what it expects."""
        rms = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.float() * rms * self.weight).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables, kept as non-persistent buffers (no gradient, not checkpointed)."""

    def __init__(self, head_dim: int, context_length: int, theta: float):
        super().__init__()
        # On the CPU whatever the default device, then moved there: on the meta device (the launcher's checks)
        # this arithmetic with Python numbers runs through torch._refs, whose first use imports torch._dynamo.
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
        angles = torch.outer(torch.arange(context_length, device="cpu").float(), inv_freq)
        self.register_buffer("cos", angles.cos().to(torch.get_default_device()), persistent=False)
        self.register_buffer("sin", angles.sin().to(torch.get_default_device()), persistent=False)
        self.positions: torch.Tensor | None = None
        """Under context parallelism, the global positions of this rank's tokens (a plain attribute, not a buffer:
        ranks differ, and a strategy broadcasts buffers); None: positions 0 .. seq-1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, heads, seq, head_dim); rotate interleaved pairs.
        at = slice(0, x.shape[-2]) if self.positions is None else self.positions
        cos, sin = self.cos[at].to(x.dtype), self.sin[at].to(x.dtype)  # rotate in x's dtype (bf16 under fsdp)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return out.flatten(-2)


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CausalSelfAttention(nn.Module):
    """q, k and v from one fused projection. The heads it computes are read from the projection's width, so
    under tensor parallelism (each rank holding its heads' rows of q, k and v) the same forward runs a
    rank's share of the heads. `attend` is the attention over the tokens: the causal SDPA, or under context
    parallelism one that exchanges the tokens other ranks hold (ddp_lab/context_parallel/)."""

    def __init__(self, d_model: int, num_heads: int, rope: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.rope = rope
        self.attend = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, -1, self.head_dim)).permute(2, 0, 3, 1, 4)
        q, k = self.rope(q), self.rope(k)
        y = self.attend(q, k, v)
        return self.proj(y.transpose(1, 2).flatten(2))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d_model: int, num_heads: int, d_ff: int, rope: RotaryEmbedding):
        super().__init__()
        self.ln1 = RMSNorm(d_model)
        self.attn = CausalSelfAttention(d_model, num_heads, rope)
        self.ln2 = RMSNorm(d_model)
        self.ffn = SwiGLU(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, vocab_size: int, context_length: int, d_model: int, d_ff: int,
                 num_layers: int, num_heads: int, rope_theta: float = 10000.0):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.context_length, self.head_dim = context_length, d_model // num_heads
        self.embed = nn.Embedding(vocab_size, d_model)
        # One RoPE table shared by every layer (a buffer, not a parameter).
        rope = RotaryEmbedding(d_model // num_heads, context_length, rope_theta)
        self.blocks = nn.ModuleList(Block(d_model, num_heads, d_ff, rope) for _ in range(num_layers))
        self.ln_final = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 1 / math.sqrt(module.weight.shape[-1])
            nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_final(x))

    def context_parallel(self, attend, positions: torch.Tensor) -> None:
        """Context parallelism (ddp_lab/context_parallel/): every attention exchanges through `attend(q, k, v)`, and
        the rotary embedding reads this rank's tokens at their global `positions`."""
        for block in self.blocks:
            block.attn.attend = attend
            block.attn.rope.positions = positions

    def pp_layers(self) -> tuple[list[str], list[list[str]], list[str]]:
        """The forward as a chain for pipeline parallelism (ddp_lab/pipeline_parallel/stages.py): the embedding,
        each block, then the final norm and the output head."""
        return ["embed"], [[f"blocks.{i}"] for i in range(len(self.blocks))], ["ln_final", "lm_head"]

    def tp_plan(self) -> dict:
        """How tensor parallelism splits this model (spec/parallel.py's styles), Megatron's way as torchtitan
        plans its Llama: the embedding and the output by vocabulary, attention by heads (q, k and v column-wise
        from one input made whole once, the output projection row-wise), SwiGLU along d_ff (w1 and w3
        column-wise, w2 row-wise), the norms on sequence shards under sequence parallelism."""
        heads = Colwise(chunks=3, unit=self.head_dim, what="model.num_heads")
        plan = {"embed": VocabEmbedding()}
        for i in range(len(self.blocks)):
            b = f"blocks.{i}"
            plan.update({f"{b}.ln1": SequenceNorm(), f"{b}.attn": PrepareInput(), f"{b}.attn.qkv": heads,
                         f"{b}.attn.proj": Rowwise(what="model.num_heads"), f"{b}.ln2": SequenceNorm(),
                         f"{b}.ffn": PrepareInput(), f"{b}.ffn.w1": Colwise(what="model.d_ff"),
                         f"{b}.ffn.w3": Colwise(what="model.d_ff"), f"{b}.ffn.w2": Rowwise(what="model.d_ff")})
        plan.update({"ln_final": SequenceNorm(), "lm_head": VocabHead()})
        return plan
