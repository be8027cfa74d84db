"""Context parallelism said without torch: which tokens of a sequence each rank holds, what each implementation
exchanges, how much attention work each rank does, and why a layout cannot run.

`parallel.cp` ranks split every sequence for every layer, attention included (Megatron's sequence parallelism
splits only the norm regions). A sequence of S tokens is cut into equal chunks:

- `ring` and `ulysses`: cp chunks, rank r holds chunk r (contiguous);
- `zigzag` and `torch`: 2 cp chunks, rank r holds chunks r and 2cp-1-r, so each rank has an early and a late
  part of the causal triangle (torch's "round robin" load balancer lays tokens out the same way);
- `hybrid`: Ulysses inside groups of `cp_ulysses` consecutive ranks, a ring across the groups: contiguous, so a
  group's tokens are one block of the sequence.

Attention between a chunk of queries i and a chunk of keys j is full when j < i, causal (the diagonal block)
when j = i, and skipped when j > i. The runtime (ddp_lab/context_parallel/) counts what it sends and the blocks it
computes; the tests hold those counts to the formulas here, and docs/context.md derives them.
"""

from __future__ import annotations

from ddp_lab.spec.choices import Choice


class CPImpl(Choice):
    ring = "ring"
    """K/V blocks passed around a ring of the cp ranks (point-to-point), merged by log-sum-exp; contiguous split."""
    zigzag = "zigzag"
    """The ring over a zigzag split (rank r holds chunks r and 2cp-1-r): every rank does the same causal work."""
    ulysses = "ulysses"
    """All-to-all from sequence shards to head shards, the model's attention over the whole sequence, and back."""
    hybrid = "hybrid"
    """Ulysses inside groups of parallel.cp_ulysses ranks, the ring across the groups."""
    torch = "torch"
    """torch's ring template (torch.distributed.tensor.experimental's `_templated_ring_attention` and its backward)
    over the zigzag split, with the model's attention kernel."""


ZIGZAG_LAYOUTS = ("zigzag", "torch")
DEFAULT_ULYSSES = 2
"""parallel.cp_ulysses's default (spec/parallel.py's ParallelConfig)."""


def chunks_per_sequence(cp: int, impl: str) -> int:
    """How many equal chunks a sequence is cut into."""
    return 2 * cp if impl in ZIGZAG_LAYOUTS else cp


def chunks_of(cp_rank: int, cp: int, impl: str) -> list[int]:
    """The chunk indices rank `cp_rank` holds, in the order its tokens are laid out."""
    if impl in ZIGZAG_LAYOUTS:
        return [cp_rank, 2 * cp - 1 - cp_rank]
    return [cp_rank]


def positions_of(cp_rank: int, cp: int, impl: str, length: int) -> list[int]:
    """The global positions (0 .. length-1) of the tokens rank `cp_rank` holds: what its rotary embedding and its
    rows of every batch are read at."""
    chunk = length // chunks_per_sequence(cp, impl)
    return [c * chunk + t for c in chunks_of(cp_rank, cp, impl) for t in range(chunk)]


def ring_of(cp: int, impl: str, ulysses: int) -> int:
    """How many members the ring has: cp for ring/zigzag/torch, cp / cp_ulysses for hybrid, 1 for Ulysses."""
    if impl == "ulysses":
        return 1
    if impl == "hybrid":
        return cp // ulysses
    return cp


def ulysses_of(cp: int, impl: str, ulysses: int) -> int:
    """How many ranks one all-to-all spans: cp for Ulysses, cp_ulysses for hybrid, 1 for the rings."""
    return {"ulysses": cp, "hybrid": ulysses}.get(impl, 1)


# --- the bytes each rank sends per attention call ----------------------------------------------------------


def exchange_bytes(impl: str, cp: int, ulysses: int, tokens: int, width: int, kv_width: int, element_bytes: int,
                   grad_bytes: int | None = None) -> dict[str, int]:
    """Bytes one rank sends in one attention layer's forward and backward (its ring's and all-to-alls' payload; an
    all-to-all counts the parts a rank sends to the others, not its own part). `tokens`: the rank's tokens (its
    sequences x its share of the context), `width`: q's features on this rank (heads x head_dim), `kv_width`: k's
    (and v's), `element_bytes`: the activations', `grad_bytes`: the ring's dK/dV accumulators' (fp32 under bf16 or
    fp16; default the activations').

    Ring over W members: forward, K and V to the next member W-1 times, 2(W-1)·t·d_kv·b; backward, K and V again
    (they were not kept) and the dK/dV accumulators, which travel with their block and reach their owner after
    W-1 hops, 2(W-1)·t·d_kv·(b + b_grad). Ulysses over U ranks: q, k, v to heads and the output back, each
    sending (U-1)/U of the tensor: (U-1)/U·t·(2d + 2d_kv)·b forward, the same backward. Hybrid: Ulysses over the
    group, then the ring over W = cp/U members whose blocks are the group's tokens of this rank's heads (t·U
    tokens x d_kv/U features: the same bytes as t x d_kv). torch's template: its default rotation all-gathers K/V
    once (each rank sends (W-1)/W of the gathered whole: the ring's forward bytes), in backward once more, and
    rotates the dK/dV accumulators W times (once more than the lab's ring), in the activations' dtype as the lab
    calls it (convert_to_f32 off)."""
    b, g = element_bytes, grad_bytes or element_bytes
    forward = backward = 0
    u = ulysses_of(cp, impl, ulysses)
    if u > 1:
        moved = (u - 1) * tokens * (2 * width + 2 * kv_width) * b // u
        forward += moved
        backward += moved
    ring = ring_of(cp, impl, ulysses)
    if ring > 1:
        kv = 2 * tokens * kv_width
        forward += (ring - 1) * kv * b
        hops = ring if impl == "torch" else ring - 1
        backward += (ring - 1) * kv * b + hops * kv * (b if impl == "torch" else g)
    return {"forward": forward, "backward": backward}


# --- the attention work each rank does ----------------------------------------------------------------------


def block_pairs(cp_rank: int, cp: int, impl: str, ulysses: int, length: int, heads: int = 1) -> dict[str, int]:
    """Query-key pairs rank `cp_rank` scores in one causal attention over a sequence of `length` tokens, times the
    heads it scores them for (`heads`: the rank's before any exchange; a Ulysses rank scores its 1/U of them over U
    times the tokens): `full` (blocks wholly under the diagonal), `diagonal` (the causal blocks: c(c+1)/2 pairs
    each), `skipped` (blocks above it, never computed), and `chunk`, the block's side c."""
    u = ulysses_of(cp, impl, ulysses)
    ring = ring_of(cp, impl, ulysses)
    per = heads // u
    if ring == 1:  # Ulysses: the whole causal attention over 1/U of the heads
        return {"full": 0, "diagonal": length * (length + 1) // 2 * per, "skipped": 0, "chunk": length}
    member = cp_rank // u if impl == "hybrid" else cp_rank
    layout = "ring" if impl == "hybrid" else impl
    chunk = length // chunks_per_sequence(ring, layout)
    mine = chunks_of(member, ring, layout)
    every = [j for r in range(ring) for j in chunks_of(r, ring, layout)]
    full = sum(1 for i in mine for j in every if j < i)
    diagonal = sum(1 for i in mine for j in every if j == i)
    skipped = sum(1 for i in mine for j in every if j > i)
    return {"full": full * chunk * chunk * per, "diagonal": diagonal * chunk * (chunk + 1) // 2 * per,
            "skipped": skipped * chunk * chunk * per, "chunk": chunk}


def work_pairs(cp_rank: int, cp: int, impl: str, ulysses: int, length: int, heads: int = 1) -> int:
    """The query-key pairs rank `cp_rank` scores, times the heads it scores them for (full + diagonal)."""
    p = block_pairs(cp_rank, cp, impl, ulysses, length, heads)
    return p["full"] + p["diagonal"]


def imbalance(cp: int, impl: str, ulysses: int, length: int) -> float:
    """The busiest rank's attention work over the mean rank's: up to 2 - 1/cp for a contiguous causal ring (as
    c grows), 1 for zigzag and Ulysses."""
    heads = ulysses_of(cp, impl, ulysses)
    work = [work_pairs(r, cp, impl, ulysses, length, heads) for r in range(cp)]
    return max(work) * len(work) / sum(work)


def attention_flops(pair_heads: int, head_dim: int, sequences: int) -> int:
    """Forward FLOPs of scoring `pair_heads` query-key pairs (times heads): 2·d for q·k and 2·d for p·v, per pair,
    head and sequence (the backward is about twice this)."""
    return 4 * pair_heads * head_dim * sequences


# --- what cannot run ------------------------------------------------------------------------------------------


def context_problem(cp: int, impl: str, ulysses: int, context_length: int, heads: int | None, tp: int,
                    sequence_parallel: bool) -> str | None:
    """One line saying why this context-parallel layout cannot run, or None."""
    if cp < 1:
        return f"parallel.cp must be >= 1, got {cp}"
    if ulysses < 2:
        return f"parallel.cp_ulysses must be >= 2 (a Ulysses group of one is a ring), got {ulysses}"
    if ulysses != DEFAULT_ULYSSES and (impl != "hybrid" or cp == 1):
        return (f"parallel.cp_ulysses={ulysses} sizes a hybrid's Ulysses groups: it is read with "
                f"parallel.cp_impl=hybrid and parallel.cp > 1 only")
    if cp == 1:
        return None
    if impl == "hybrid":
        if cp % ulysses or ulysses == cp:
            return (f"parallel.cp_impl=hybrid runs Ulysses inside groups of parallel.cp_ulysses ranks and a ring "
                    f"across them: parallel.cp_ulysses={ulysses} must divide parallel.cp={cp} and be smaller than it "
                    "(cp_ulysses = cp is cp_impl=ulysses)")
    chunks = chunks_per_sequence(cp, impl)
    if context_length % chunks:
        why = (f"2 x parallel.cp = {chunks} chunks (rank r holds chunks r and {chunks}-1-r)"
               if impl in ZIGZAG_LAYOUTS else f"parallel.cp={cp} chunks")
        return (f"parallel.cp_impl={impl} cuts each sequence into {why}: model.context_length={context_length} "
                f"does not divide by {chunks} (never silently unbalanced: use a context length that does)")
    local = context_length // cp
    if sequence_parallel and local % tp:
        return (f"parallel.sequence_parallel=true splits each rank's {local} tokens (model.context_length / "
                f"parallel.cp) over parallel.tp={tp}: it does not divide")
    u = ulysses_of(cp, impl, ulysses)
    if u > 1 and heads is not None and heads % (u * tp):
        split = f"{u} ranks" + (f" of each of parallel.tp={tp} ranks' heads" if tp > 1 else "")
        return (f"parallel.cp_impl={impl} gives each of {split} a share of the heads: model.num_heads={heads} does "
                f"not divide by {u * tp}")
    return None
