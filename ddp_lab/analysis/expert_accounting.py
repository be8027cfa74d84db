"""The calculator on expert parallelism (`--ep`): a mixture of experts' parameters in all and active per token, its
FLOPs per token, what a rank holds of the experts at each ep, and the all-to-all's bytes and time beside the experts'
compute.

    python -m ddp_lab.calculator --model deepseek_v3 --ep 8,32,64 --tokens 4096
    python -m ddp_lab.calculator --model tiny_moe --ep 1,2,4

Counted, not run. The published shapes are written out from their published configurations (`SHAPES`, each with
its source); the lab's mixtures (tiny_moe, small_moe) are read from their config nodes. Parameters: attention by its
kind (grouped-query, or DeepSeek's multi-head latent attention with its low-rank projections), the dense layers'
SwiGLU, every MoE layer's routed experts (3 x d x h each), shared experts and router, the embedding and the output
(untied). A token reaches top_k routed experts: the active count keeps those and everything dense. FLOPs per token
for training: 6 x the active matrix parameters (the embedding's lookup excluded; attention's scores, which grow with
the context, left out and said so). Bytes per rank per step of the all-to-all: spec/experts.py's formula,
4·T·k·d·b·(P−1)/P per MoE layer (an even load), in the activations' dtype (bf16 under --dtype bf16). The experts'
compute per rank per step: its T·k rows through 3 x d x h multiply-adds, forward and backward (6 FLOPs each), at the
device's peak; the all-to-all at --bandwidth, not hidden (the lab's blocks: docs/experts.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddp_lab.arithmetic.zero_bytes import DTYPE_BYTES
from ddp_lab.units import fmt_bytes


@dataclass(frozen=True)
class MoEShape:
    """A mixture of experts as its published configuration gives it."""

    name: str
    source: str
    vocab: int
    d_model: int
    layers: int
    dense_layers: int
    """Leading layers with a dense SwiGLU instead of experts (DeepSeek-V3's first 3)."""
    dense_d_ff: int
    experts: int
    top_k: int
    expert_d_ff: int
    shared_experts: int
    heads: int
    kv_heads: int = 0
    head_dim: int = 0
    mla: tuple[int, int, int, int, int] | None = None
    """DeepSeek's latent attention: (q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)."""
    tied: bool = False

    def attention(self) -> int:
        """Attention's weights in one layer (norms left out: a few thousand)."""
        d = self.d_model
        if self.mla is None:
            return d * self.heads * self.head_dim * 2 + 2 * d * self.kv_heads * self.head_dim
        q_rank, kv_rank, nope, rope, v = self.mla
        return (d * q_rank + q_rank * self.heads * (nope + rope) + d * (kv_rank + rope)
                + kv_rank * self.heads * (nope + v) + self.heads * v * d)

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    def expert_params(self) -> int:
        """One routed expert's weights (w1, w3: d x h; w2: h x d)."""
        return 3 * self.d_model * self.expert_d_ff

    def counts(self) -> dict:
        """Parameters: total, active per token, the routed experts', and the embedding's lookup."""
        d, moe = self.d_model, self.moe_layers
        routed = moe * self.experts * self.expert_params()
        shared = moe * self.shared_experts * self.expert_params()
        router = moe * self.experts * d
        dense = self.dense_layers * 3 * d * self.dense_d_ff
        embedding = self.vocab * d
        head = 0 if self.tied else self.vocab * d
        common = self.layers * self.attention() + shared + router + dense + embedding + head
        active_routed = moe * self.top_k * self.expert_params()
        return {"total": common + routed, "active": common + active_routed, "routed_experts": routed,
                "lookup": embedding}


SHAPES = {shape.name: shape for shape in (
    MoEShape("deepseek_v3", "deepseek-ai/DeepSeek-V3 config.json (671B; the multi-token-prediction module left out)",
             vocab=129280, d_model=7168, layers=61, dense_layers=3, dense_d_ff=18432, experts=256, top_k=8,
             expert_d_ff=2048, shared_experts=1, heads=128, mla=(1536, 512, 128, 64, 128)),
    MoEShape("mixtral_8x7b", "mistralai/Mixtral-8x7B-v0.1 config.json (46.7B, 12.9B active)", vocab=32000,
             d_model=4096, layers=32, dense_layers=0, dense_d_ff=0, experts=8, top_k=2, expert_d_ff=14336,
             shared_experts=0, heads=32, kv_heads=8, head_dim=128),
    MoEShape("qwen3_235b_a22b", "Qwen/Qwen3-235B-A22B config.json (235B, 22B active)", vocab=151936, d_model=4096,
             layers=94, dense_layers=0, dense_d_ff=0, experts=128, top_k=8, expert_d_ff=1536, shared_experts=0,
             heads=64, kv_heads=4, head_dim=128),
)}
"""The published mixtures the calculator and the planner price, by the name `--model` takes."""


def lab_shape(model_cfg) -> MoEShape:
    """One of the lab's mixtures (a MoETransformer's node) as a shape: multi-head attention, untied."""
    heads = int(model_cfg.num_heads)
    return MoEShape(str(model_cfg.get("name", "?")), "conf/model", int(model_cfg.vocab_size), int(model_cfg.d_model),
                    int(model_cfg.num_layers), 0, 0, int(model_cfg.experts), int(model_cfg.top_k),
                    int(model_cfg.expert_d_ff), int(model_cfg.shared_experts), heads, heads,
                    int(model_cfg.d_model) // heads)


def expert_accounting(shape: MoEShape, eps: list[int], tokens: int, dtype: str = "bf16", flops: float = 989e12,
                      bandwidth: float = 450e9) -> dict:
    """The ep report: the shape's counts and, per ep, what a rank holds and moves for `tokens` tokens a step."""
    from ddp_lab.spec.experts import all_to_all_bytes

    counts = shape.counts()
    state, wire = sum(DTYPE_BYTES[dtype]), DTYPE_BYTES[dtype][0]
    rows = []
    for ep in eps:
        if ep < 1 or shape.experts % ep:
            rows.append({"ep": ep, "problem": f"--ep={ep} must be >= 1 and divide the {shape.experts} experts"})
            continue
        experts_per_rank = shape.experts // ep
        held = counts["total"] - counts["routed_experts"] + counts["routed_experts"] // ep
        a2a = shape.moe_layers * all_to_all_bytes(tokens, shape.top_k, shape.d_model, wire, ep)
        compute = 6 * tokens * shape.top_k * shape.expert_params() * shape.moe_layers
        rows.append({"ep": ep, "experts_per_rank": experts_per_rank, "params_per_rank": held,
                     "expert_state_bytes": counts["routed_experts"] // ep * state,
                     "state_bytes": held * state, "a2a_bytes": a2a, "a2a_s": a2a / bandwidth,
                     "expert_flops": compute, "expert_s": compute / flops})
    return {"model": shape.name, "source": shape.source, "counts": counts, "dtype": dtype, "tokens": tokens,
            "flops": flops, "bandwidth": bandwidth,
            "flops_per_token": 6 * (counts["active"] - counts["lookup"]), "moe_layers": shape.moe_layers,
            "experts": shape.experts, "top_k": shape.top_k, "rows": rows}


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def format_expert_report(r: dict) -> str:
    c = r["counts"]
    lines = [f"model {r['model']} ({r['source']}): {_count(c['total'])} parameters, {_count(c['active'])} active per "
             f"token; {r['experts']} routed experts, top-{r['top_k']}, {r['moe_layers']} MoE layers",
             f"training FLOPs/token (6 x active matmul parameters, attention's scores left out): "
             f"{r['flops_per_token']:.3e}",
             f"{r['tokens']:,} tokens per rank a step, {r['dtype']} ({sum(DTYPE_BYTES[r['dtype']])} bytes/param of "
             f"state, activations on the wire in {DTYPE_BYTES[r['dtype']][0]} bytes), "
             f"{r['flops'] / 1e12:g} TFLOP/s, {r['bandwidth'] / 1e9:g} GB/s per rank",
             "",
             f"{'ep':>5} {'experts/rank':>12} {'params/rank':>12} {'expert state':>13} {'state':>11} "
             f"{'a2a/step':>11} {'a2a ms':>9} {'experts ms':>10} {'a2a/experts':>11}"]
    for row in r["rows"]:
        if "problem" in row:
            lines.append(f"{row['ep']:>5} {row['problem']}")
            continue
        ratio = row["a2a_s"] / row["expert_s"] if row["expert_s"] else float("inf")
        lines.append(f"{row['ep']:>5} {row['experts_per_rank']:>12} {_count(row['params_per_rank']):>12} "
                     f"{fmt_bytes(row['expert_state_bytes']):>13} {fmt_bytes(row['state_bytes']):>11} "
                     f"{fmt_bytes(row['a2a_bytes']):>11} {row['a2a_s'] * 1e3:>9.3f} {row['expert_s'] * 1e3:>10.3f} "
                     f"{ratio:>11.2f}")
    lines += ["", "state: the model state a rank holds (dense weights whole, its experts / ep), as the ZeRO paper "
              "counts bytes per parameter, sharded by no data-parallel strategy; a2a: the all-to-all's bytes a rank "
              "sends in a step (an even load), at the bandwidth, not hidden; experts ms: its routed experts' "
              "forward and backward at peak FLOP/s."]
    return "\n".join(lines)
