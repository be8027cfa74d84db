"""The calculator on context parallelism (`--cp`): per implementation what a rank sends per step, the attention
work of the busiest rank and the mean one, the time the exchange and the attention take at the device's rates,
the activations a rank holds and the longest context that fits the device.

    python -m ddp_lab.calculator --model small --world-size 8 --cp 4 --batch 2 --set context_length=16384

Counted, not run: the bytes are spec/context.py's `exchange_bytes` per layer (the formulas the runtime's counts are
held to), the work its `work_pairs` (query-key pairs scored per rank, times heads) at 4 x head_dim FLOPs per pair
forward and twice that backward; a rank's activations are the model's (models/facts.py's `activation_bytes`:
what autograd saves, an upper bound) over cp, linear in the tokens a rank holds (the CPU's attention kernel saves
no score matrix); the model state is whole on every cp rank (`--dtype`'s bytes per parameter, as the ZeRO paper
counts them, sharded by no strategy). A ring's exchange can hide under the blocks' attention (the busiest rank's:
the others wait for it); Ulysses' all-to-alls block, all exposed.
"""

from __future__ import annotations

from ddp_lab.arithmetic.zero_bytes import DTYPE_BYTES, model_state_bytes
from ddp_lab.models.facts import activation_bytes, parameter_counts
from ddp_lab.spec.context import (
    CPImpl,
    attention_flops,
    chunks_per_sequence,
    context_problem,
    exchange_bytes,
    ring_of,
    work_pairs,
)

IMPLS = tuple(impl.value for impl in CPImpl)


def context_accounting(model_cfg, world_size: int, cp: int, batch: int, dtype: str = "bf16",
                       flops: float = 989e12, bandwidth: float = 450e9, device_gb: float = 80.0,
                       ulysses: int = 2, impls: tuple[str, ...] = IMPLS) -> dict:
    """The context report of `model_cfg` (a Transformer's node: context_length, d_model, num_heads, num_layers) on
    `world_size` ranks of which `cp` split each sequence, `batch` sequences in the global batch."""
    if cp < 1 or world_size % cp:
        raise ValueError(f"--cp={cp} must be >= 1 and divide --world-size={world_size}")
    dp = world_size // cp
    if batch % dp:
        raise ValueError(f"--batch={batch} sequences do not divide over the {dp} data-parallel ranks "
                         f"(world size / cp)")
    length, heads, layers = model_cfg.context_length, model_cfg.num_heads, model_cfg.num_layers
    width = model_cfg.d_model
    head_dim = width // heads
    sequences = batch // dp
    tokens = sequences * length // cp
    wire = DTYPE_BYTES[dtype][1]
    grads = max(wire, 4)  # the ring's dK/dV accumulators: fp32 under bf16
    n = parameter_counts(model_cfg)["total"]
    state = model_state_bytes(n, dtype, 1, 0)["total"]
    per_token = activation_bytes(model_cfg, 1) / length  # one sequence's, per token: linear in the tokens
    activations = per_token * sequences * length / cp
    device = device_gb * 1e9
    rows = []
    for impl in impls:
        problem = context_problem(cp, impl, ulysses, length, heads, 1, False)
        if problem is not None:
            rows.append({"impl": impl, "problem": problem})
            continue
        sent = exchange_bytes(impl, cp, ulysses, tokens, width, width, wire, grads)
        work = [work_pairs(r, cp, impl, ulysses, length, heads) for r in range(cp)]
        busiest, mean = max(work), sum(work) / len(work)
        attention_s = 3 * attention_flops(busiest, head_dim, sequences) * layers / flops  # forward + 2x backward
        exchange_s = layers * (sent["forward"] + sent["backward"]) / bandwidth
        members = ring_of(cp, impl, ulysses)
        if impl in ("ring", "zigzag", "hybrid"):  # the ring's part can hide under the blocks; Ulysses' cannot
            around = exchange_bytes("ring", members, ulysses, tokens, width, width, wire, grads)
            ring_s = layers * (around["forward"] + around["backward"]) / bandwidth
            exposed_s = exchange_s - ring_s + max(0.0, ring_s - attention_s)
        else:  # Ulysses blocks; torch's template overlaps as it does, which the lab does not model
            exposed_s = exchange_s if impl == "ulysses" else None
        room = device - state
        fits = int(room / (per_token * sequences)) * cp if room > 0 else 0
        fits -= fits % chunks_per_sequence(cp, impl)
        rows.append({"impl": impl, "bytes_forward": layers * sent["forward"],
                     "bytes_backward": layers * sent["backward"], "pairs_busiest": busiest, "pairs_mean": mean,
                     "imbalance": busiest / mean, "attention_flops_busiest": attention_flops(busiest, head_dim,
                                                                                              sequences) * layers,
                     "attention_s": attention_s, "exchange_s": exchange_s, "exposed_s": exposed_s,
                     "hides": {"ulysses": "blocking all-to-all", "hybrid": "its ring under attention",
                               "torch": "inside torch's template"}.get(impl, "under attention"),
                     "longest_context": fits})
    return {"model": model_cfg.get("name"), "world_size": world_size, "cp": cp, "dp": dp, "batch": batch,
            "context_length": length, "tokens_per_rank": tokens, "dtype": dtype, "flops": flops,
            "bandwidth": bandwidth, "device_bytes": device, "model_state_bytes": state,
            "activation_bytes_per_rank": activations, "activation_bytes_per_token": per_token,
            "fits": state + activations <= device, "impls": rows}


def format_context_report(r: dict) -> str:
    lines = [f"model={r['model']}: {r['world_size']} ranks = dp {r['dp']} x cp {r['cp']}, a global batch of "
             f"{r['batch']} x {r['context_length']} tokens, {r['tokens_per_rank']} tokens per rank; {r['dtype']}, "
             f"{r['flops']:.3g} FLOP/s, {r['bandwidth']:.3g} B/s",
             f"memory per rank: model state {r['model_state_bytes'] / 1e9:.2f} GB (whole on every cp rank) + "
             f"activations {r['activation_bytes_per_rank'] / 1e9:.2f} GB "
             f"({r['activation_bytes_per_token'] / 2**20:.3f} MiB per token held, over cp) "
             f"{'fits' if r['fits'] else 'does NOT fit'} {r['device_bytes'] / 1e9:.0f} GB",
             "",
             f"{'impl':<8} {'fwd MiB':>9} {'bwd MiB':>9} {'work max/mean':>13} {'attn ms':>9} {'exch ms':>9} "
             f"{'exposed ms':>10}  {'longest context':>15}  exchange"]
    for row in r["impls"]:
        if "problem" in row:
            lines.append(f"{row['impl']:<8} refused: {row['problem']}")
            continue
        lines.append(f"{row['impl']:<8} {row['bytes_forward'] / 2**20:>9.1f} {row['bytes_backward'] / 2**20:>9.1f} "
                     f"{row['imbalance']:>13.2f} {1e3 * row['attention_s']:>9.2f} {1e3 * row['exchange_s']:>9.2f} "
                     + (f"{1e3 * row['exposed_s']:>10.2f}" if row["exposed_s"] is not None else f"{'-':>10}")
                     + f"  {row['longest_context']:>15}  {row['hides']}")
    lines.append("")
    lines.append("fwd/bwd MiB: one rank's sends per step (every layer); work: the busiest rank's query-key pairs over "
                 "the mean's; attn: the busiest rank's attention, forward and backward; exposed: the exchange beyond "
                 "the attention it can hide under (all of it for Ulysses' blocking all-to-alls); longest context: "
                 "the most tokens per sequence whose activations fit beside the model state.")
    return "\n".join(lines)
