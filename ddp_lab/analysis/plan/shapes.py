"""The model shapes the planner prices: a Transformer by its sizes, from a conf model (counted as the lab builds it:
ddp_lab/models/transformer.py, SwiGLU, untied head) or a published Llama shape, or the course's feed-forward stack
(model=xxl_ffn: ddp_lab/models/ffn.py). Nothing allocated, ever."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Shape:
    """A decoder-only Transformer by its sizes. Parameters per block: attention's q and o (d x d each) and k and v
    (d x d_kv each, d_kv = d x kv_heads / heads: grouped-query attention), SwiGLU's three (d x d_ff), two norms; the
    embedding and the output head each vocab x d (untied), and the final norm.

    `kind="ffn"`: the course's feed-forward stack instead (model=xxl_ffn): each block two bias-free linears
    d -> d_ff -> d and nothing else, no attention, embedding, head or norm."""

    name: str
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    d_ff: int
    vocab: int
    context: int
    source: str = ""
    kind: str = "transformer"
    lab_block: bool = False
    """A conf model's Transformer, whose block saves what the lab's block saves (`saved_bytes_per_token`)."""

    @property
    def ffn(self) -> bool:
        return self.kind == "ffn"

    @property
    def d_kv(self) -> int:
        return 0 if self.ffn else self.d_model * self.kv_heads // self.heads

    @property
    def block_params(self) -> int:
        return int(sum(self.block_tensors()))

    @property
    def params(self) -> int:
        if self.ffn:
            return self.layers * self.block_params
        return self.layers * self.block_params + 2 * self.vocab * self.d_model + self.d_model

    def block_flops(self, context: int) -> float:
        """Forward FLOPs per token of one block: 2 per weight of its matmuls, and causal attention's scores and
        weighted sum (2 x context x d each over the whole square; the causal half: 2 x context x d together)."""
        if self.ffn:
            return 2 * self.block_params
        d = self.d_model
        return 2 * (2 * d * d + 2 * d * self.d_kv + 3 * d * self.d_ff) + 2 * context * d

    def attention_flops(self, context: int) -> float:
        """The part of `block_flops` that selective recomputation runs again: the scores and their weighted sum."""
        return 0.0 if self.ffn else 2 * context * self.d_model

    @property
    def recomputed_elements_per_token(self) -> int:
        """Elements read and written per token by the operations selective recomputation runs again in one block:
        all but its matmuls (whose outputs it keeps) and the attention kernel (priced by its FLOPs), as the lab's
        block runs them (ddp_lab/models/transformer.py): two RMSNorms at 7 x d each (square, mean, scale, weight),
        the rotary embedding at 9 per element of q and k, the attention output's copy back to tokens (2 x d), the
        two residual adds (6 x d) and SwiGLU's SiLU and product (5 x d_ff): 22 x d + 9 x (d + d_kv) + 5 x d_ff.
        The feed-forward stack keeps everything it would recompute: 0."""
        if self.ffn:
            return 0
        return 22 * self.d_model + 9 * (self.d_model + self.d_kv) + 5 * self.d_ff

    @property
    def saved_bytes_per_token(self) -> int:
        """Activation bytes one block keeps for backward per token (bf16), before TP splits them: 34 x d for a
        Transformer block (Korthikanti et al., MLSys'23: GPT's, a GELU MLP of 4 x d, with a flash kernel: no scores
        kept), the two linears' inputs (d + d_ff) x 2 for a feed-forward one. The lab's own block keeps 13 x d + 4 x
        d_ff elements a token, as its census counts them (tests/unit/test_plan.py, two sizes, to 1%): SwiGLU's four
        d_ff-wide tensors (its two projections, their SiLU and product) and 13 d-wide ones for the rest (the norms in
        fp32, attention with its rotary embedding; counted, not itemized), 1.7x the 34 x d of model=tiny; counted here
        at 2 bytes each."""
        if self.ffn:
            return 2 * (self.d_model + self.d_ff)
        return 2 * (13 * self.d_model + 4 * self.d_ff) if self.lab_block else 34 * self.d_model

    def saved_bytes_per_token_on(self, tp: int) -> float:
        """`saved_bytes_per_token` on one of `tp` tensor-parallel GPUs. A published shape's block, run as its source
        runs it, with sequence parallelism: all of it split. The lab's block, which the lab runs without it
        (`parallel.sequence_parallel` is false unless set): its two RMSNorms' input, scaled input and output (the
        column-parallel linears' input), 6 x d a token, whole on every TP rank, the rest split by heads and by d_ff.
        The census of tp 2 x pp 4's first stage (one block) counted 4499 elements a token at context 192, where this
        gives 6 x 256 + (7 x 256 + 4 x 1024) / 2 = 4480 (docs/measured/plan_unseen_192.md)."""
        if self.ffn or not self.lab_block:
            return self.saved_bytes_per_token / tp
        whole = 2 * 6 * self.d_model
        return whole + (self.saved_bytes_per_token - whole) / tp

    @property
    def selective_saved_bytes_per_token(self) -> int:
        """What one block keeps per token under selective checkpointing (bf16), before TP splits it: the lab's block
        its input and its matmuls' outputs, as rank/recompute.py's policy keeps them (q, k and v, attention's
        projection, the MLP's three: 4 x d + 2 x d_kv + 2 x d_ff elements; tests/unit/test_recompute_census.py
        counts them on one block); a published shape keeps what it keeps without checkpointing (34 x d already
        leaves out attention's scores, which is what Korthikanti et al.'s selective recomputation drops)."""
        if self.ffn or not self.lab_block:
            return self.saved_bytes_per_token
        return 2 * (4 * self.d_model + 2 * self.d_kv + 2 * self.d_ff)

    @property
    def tp_regions(self) -> int:
        """Row-parallel layers per block, each one all-reduce forward and one backward under TP: attention's output
        and the MLP's second linear; the feed-forward block's second linear alone."""
        return 1 if self.ffn else 2

    def tp_problem(self, tp: int) -> str | None:
        """Why `tp` cannot split this shape's layers, or None."""
        if self.ffn:
            return None if self.d_ff % tp == 0 else f"tp {tp} does not divide d_ff ({self.d_ff})"
        if self.heads % tp or self.kv_heads % tp or self.d_ff % tp:
            return f"tp {tp} does not divide the heads ({self.heads}), kv heads ({self.kv_heads}) and d_ff"
        return None

    def block_tensors(self, tp: int = 1) -> list[float]:
        """The elements of each of a block's parameter tensors on one GPU, those TP splits over `tp`: q, k and v
        (the lab's block fuses them into one), attention's output, the MLP's three, and the two norms whole; the
        feed-forward stack's two linears."""
        d, d_ff = self.d_model, self.d_ff
        if self.ffn:
            return [d * d_ff / tp] * 2
        attention = [d * (d + 2 * self.d_kv) / tp] if self.lab_block else [d * d / tp, d * self.d_kv / tp,
                                                                             d * self.d_kv / tp]
        return attention + [d * d / tp] + [d * d_ff / tp] * 3 + [d, d]

    def head_flops(self) -> float:
        """Forward FLOPs per token of the output head (the embedding is a lookup)."""
        return 2 * self.vocab * self.d_model


LLAMA_SOURCE = ("Llama 3 herd paper (Dubey et al., 2024, arXiv:2407.21783), Table 3: layers, model dimension, FFN "
                "dimension, attention and key/value heads; vocabulary 128,256 (meta-llama/Llama-3.1-*'s config.json)")

PUBLISHED = {
    "llama3_8b": Shape("llama3_8b", 32, 4096, 32, 8, 14336, 128256, 8192, LLAMA_SOURCE),
    "llama3_70b": Shape("llama3_70b", 80, 8192, 64, 8, 28672, 128256, 8192, LLAMA_SOURCE),
    "llama3_405b": Shape("llama3_405b", 126, 16384, 128, 8, 53248, 128256, 8192, LLAMA_SOURCE),
}


def from_conf(cfg) -> Shape:
    """A conf model's shape (conf/model/NAME.yaml, composed as launch.py composes it): multi-head attention, or the
    feed-forward stack (a model without heads)."""
    if "num_heads" not in cfg:
        return Shape(str(cfg.get("name", "model")), int(cfg.num_layers), int(cfg.d_model), 1, 1, int(cfg.d_ff), 0,
                     int(cfg.context_length), f"conf/model/{cfg.get('name', 'model')}.yaml", kind="ffn")
    return Shape(str(cfg.get("name", "model")), int(cfg.num_layers), int(cfg.d_model), int(cfg.num_heads),
                 int(cfg.num_heads), int(cfg.d_ff), int(cfg.vocab_size), int(cfg.context_length),
                 f"conf/model/{cfg.get('name', 'model')}.yaml", lab_block=True)


def with_context(shape: Shape, context: int | None) -> Shape:
    if context is None:
        return shape
    return replace(shape, context=int(context))
