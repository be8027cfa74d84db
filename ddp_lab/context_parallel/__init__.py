"""Context parallelism on the mesh's `cp` axis: every sequence split over the cp ranks for every layer.

`ContextParallel(layout, cp_rank, cp_group, impl, ulysses)` is built once per rank by `Parallelism`
(ddp_lab/parallel/): it says which tokens of every sequence this rank holds (spec/context.py's layout: contiguous,
or zigzag), hands the model the global positions of those tokens (its rotary embedding reads them) and the attention
that exchanges what the rank does not hold: the ring (ring.py, contiguous or zigzag), Ulysses (ulysses.py), Ulysses
inside groups with a ring across them (hybrid), or torch's ring template (torch_ring.py). Everything else in a layer
is per token and needs no exchange. The model asks for it through `context_parallel(attend, positions)`; a model
without that method does not run under context parallelism (the launcher refuses it).

The loss of a rank is the mean over its tokens; every rank holds as many tokens, so the strategy's average over
dp x cp is the gradient of the mean over every token of the global batch, and the logged loss (the mean over
ranks) is that mean, not a cp-th of it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_lab.context_parallel.exchange import Ring, Tally
from ddp_lab.context_parallel.ring import LocalAttention, ring_attention
from ddp_lab.context_parallel.torch_ring import torch_ring_attention
from ddp_lab.context_parallel.ulysses import ulysses_attention
from ddp_lab.spec.context import imbalance, positions_of, ring_of, ulysses_of
from ddp_lab.spec.figures import CP_ATTENTION, CP_BYTES_BACKWARD, CP_BYTES_FORWARD, CP_EXPOSED, CP_PAIRS


class ContextParallel:
    def __init__(self, layout, cp_rank: int, cp_group, impl: str, ulysses: int):
        """`layout`: the job's MeshLayout; `cp_group`: this rank's cp process group; `impl`: parallel.cp_impl;
        `ulysses`: parallel.cp_ulysses (hybrid). Collective: a hybrid's Ulysses groups are built by every rank."""
        self.cp, self.rank, self.impl = layout.cp, cp_rank, impl
        self.tally = Tally()
        self.length, self.device = 0, torch.device("cpu")  # the context length and device, once applied
        self.history: list[dict] = []  # each training step's figures (pop), for the summary
        self.blocks: list = []  # the K/V blocks of a training step's ring calls, for the exchange alone
        me = dist.get_rank()
        groups = layout.cp_groups()
        members = next(g for g in groups if me in g)
        self.u = ulysses_of(self.cp, impl, ulysses)
        self.ring_size = ring_of(self.cp, impl, ulysses)
        self.group, self.ulysses_group = cp_group, None
        if impl == "ulysses":
            self.ulysses_group = cp_group
        elif impl == "hybrid":
            self.ulysses_group, _ = dist.new_subgroups_by_enumeration(
                [g[i:i + self.u] for g in groups for i in range(0, len(g), self.u)])
        a = self.rank % self.u
        self.ring = Ring(members[a::self.u] if impl == "hybrid" else members, self.tally) if self.ring_size > 1 \
            else None

    # --- what the model and the data read ------------------------------------------------------------------

    def positions(self, length: int, device) -> torch.Tensor:
        """The global positions of this rank's tokens of a sequence of `length`."""
        layout = "ring" if self.impl in ("ulysses", "hybrid") else self.impl
        return torch.tensor(positions_of(self.rank, self.cp, layout, length), dtype=torch.long, device=device)

    def apply(self, module: torch.nn.Module, length: int, device) -> None:
        """Hand the model this rank's positions and the attention that exchanges the rest (its
        `context_parallel(attend, positions)`)."""
        self.length, self.device = length, device
        module.context_parallel(self.attend, self.positions(length, device))

    @torch.compiler.disable
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries over every token of the sequence (q, k, v: batch, heads, local
        tokens, head_dim, rotary positions already applied). Under train.compile a graph break: the exchange and
        its blocks' attention run eager, timed as they are without compile."""
        if self.impl == "torch":
            return torch_ring_attention(q, k, v, self.group, self.cp, self.tally)
        if self.impl in ("ring", "zigzag"):
            return ring_attention(q, k, v, self.ring, self.impl)
        inner = (lambda q_, k_, v_: LocalAttention.apply(q_, k_, v_, self.tally)) if self.impl == "ulysses" else (
            lambda q_, k_, v_: ring_attention(q_, k_, v_, self.ring, "ring"))
        return ulysses_attention(q, k, v, self.ulysses_group, self.u, self.tally, inner)

    # --- what the loop reads -----------------------------------------------------------------------------

    def pop(self) -> dict:
        """This step's figures: bytes sent forward and backward, the time waited on exchanges, the time in attention
        blocks, the query-key pairs scored (times heads), the attention calls."""
        out = self.tally.pop()
        if self.impl == "torch":  # its blocks and waits are inside torch's template: not seen, not said to be 0
            out = {k: v for k, v in out.items() if k not in (CP_EXPOSED.key, CP_ATTENTION.key, CP_PAIRS.key)}
        self.history.append(out)
        self.blocks = self.tally.take_blocks() or self.blocks
        return out

    def drop(self) -> None:
        """Forget what ran since the last step (the held-out loss's forwards): no step's figures."""
        self.tally.pop()
        self.tally.take_blocks()

    def describe(self, warmup_steps: int = 0) -> dict:
        """The summary's context parallelism: per cp rank the mean over measured steps of its attention time,
        exposed wait and bytes, its pairs scored; the counted imbalance (the busiest rank's pairs over the mean,
        beside spec/context.py's formula), the measured one (attention time), and for a ring the exchange's time
        alone (measured here, after training) and the share of it the blocks hid on the busiest rank: 1 - its
        exposed wait / alone. Only the busiest rank's wait is the exchange's: a less busy rank of a lockstep ring
        also waits for its slower peers' blocks (the imbalance), which a mean would count as exposed transfer.
        Collective over every rank (gathered)."""
        measured = self.history[warmup_steps:] or self.history
        mean = {f.key: (sum(step[f.key] for step in measured) / len(measured)
                        if measured and f.key in measured[-1] else None)
                for f in (CP_ATTENTION, CP_EXPOSED, CP_BYTES_FORWARD, CP_BYTES_BACKWARD, CP_PAIRS)}
        alone_ms = None
        if self.ring is not None and self.blocks:
            times = []
            for _ in range(3):
                took = sum(self.ring.alone(shape, dtype, acc, self.device) for shape, dtype, acc in self.blocks)
                times.append(took * 1e3)
            alone_ms = sorted(times)[1]
        mine = {"cp_rank": self.rank, "attention_ms": mean[CP_ATTENTION.key], "exposed_ms": mean[CP_EXPOSED.key],
                "bytes_forward": mean[CP_BYTES_FORWARD.key], "bytes_backward": mean[CP_BYTES_BACKWARD.key],
                "pairs": mean[CP_PAIRS.key], "exchange_alone_ms": alone_ms}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        ranks = {}
        for entry in everyone:
            ranks.setdefault(entry["cp_rank"], entry)  # the first of each cp rank: its dp, tp, pp peers alike
        per_rank = [ranks[r] for r in sorted(ranks)]

        def ratio(key):
            values = [r[key] for r in per_rank]
            return None if None in values or not sum(values) else max(values) * len(values) / sum(values)

        busiest = max(per_rank, key=lambda r: (r["pairs"] or 0, r["attention_ms"] or 0))
        alone = busiest["exchange_alone_ms"]
        return {"cp": self.cp, "impl": self.impl, **({"cp_ulysses": self.u} if self.impl == "hybrid" else {}),
                "per_rank": per_rank, "imbalance_counted": ratio("pairs"),
                "imbalance_formula": imbalance(self.cp, self.impl, self.u, self.length) if self.length else None,
                "imbalance_measured": ratio("attention_ms"), "busiest_rank": busiest["cp_rank"],
                "exposed_ms": busiest["exposed_ms"], "exchange_alone_ms": alone,
                "hidden_pct": None if not alone or busiest["exposed_ms"] is None else
                100 * max(0.0, 1 - busiest["exposed_ms"] / alone)}
