"""What context parallelism sends, and how long a rank waited for it: one ring's point-to-point exchange, and the
tally every implementation adds its bytes, waits and attention work to.

A ring posts the next exchange (send to the next member, receive from the previous one, `batch_isend_irecv`)
before it computes the block it holds, and waits for it after: the wait is the exchange's exposed time, the part
the block's attention did not hide. Each kind of message has its own tag (keys and values, their gradients), so
two exchanges in flight on one ring never take each other's message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ddp_lab.spec.figures import CP_ATTENTION, CP_BYTES_BACKWARD, CP_BYTES_FORWARD, CP_CALLS, CP_EXPOSED, CP_PAIRS


@dataclass
class Tally:
    """One rank's context-parallel figures since the last `pop()`: bytes it sent (forward, backward), seconds it
    waited on exchanges (exposed), seconds it spent in its attention blocks, query-key pairs it scored (times
    heads), attention calls; `pop()` names them as spec/figures.py's rows."""

    sent: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})
    exposed_s: float = 0.0
    attention_s: float = 0.0
    pairs: int = 0
    calls: int = 0
    phase: str = "forward"
    blocks: list = field(default_factory=list)
    """The (shape, dtype) of each ring's K (and V) block of the last step's calls: what `Ring.alone` sends."""

    def pop(self) -> dict:
        out = {CP_BYTES_FORWARD.key: self.sent["forward"], CP_BYTES_BACKWARD.key: self.sent["backward"],
               CP_EXPOSED.key: self.exposed_s * 1e3, CP_ATTENTION.key: self.attention_s * 1e3,
               CP_PAIRS.key: self.pairs, CP_CALLS.key: self.calls}
        self.sent = {"forward": 0, "backward": 0}
        self.exposed_s = self.attention_s = 0.0
        self.pairs = self.calls = 0
        return out

    def take_blocks(self) -> list:
        blocks, self.blocks = self.blocks, []
        return blocks

    def timed(self, fn, *args):
        """`fn(*args)`, its time counted as attention."""
        start = time.perf_counter()
        out = fn(*args)
        self.attention_s += time.perf_counter() - start
        return out


class Ring:
    """One ring of ranks (a cp group, or a hybrid's ring across Ulysses groups): `member` of `size`, its
    neighbours' global ranks."""

    def __init__(self, ranks: list[int], tally: Tally):
        self.ranks, self.size = ranks, len(ranks)
        me = dist.get_rank()
        self.member = ranks.index(me)
        self.next, self.prev = ranks[(self.member + 1) % self.size], ranks[(self.member - 1) % self.size]
        self.tally = tally

    def post(self, tensors: list[torch.Tensor], tag: int) -> "Posted":
        """Send `tensors` (flattened into one buffer) to the next member and receive the same shapes from the
        previous one; returns what `wait()` gives the received tensors from."""
        send = torch.cat([t.reshape(-1) for t in tensors])
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, tag=tag), dist.P2POp(dist.irecv, recv, self.prev, tag=tag)]
        self.tally.sent[self.tally.phase] += send.numel() * send.element_size()
        return Posted(dist.batch_isend_irecv(ops), recv, [t.shape for t in tensors], self.tally)


    def alone(self, shape, dtype, grad_dtype, device) -> float:
        """Seconds one attention call's exchanges take with nothing to hide them under: forward, K and V W-1 times;
        backward, K and V W-1 times and the gradients W-1 times, each posted and waited for in turn, on a ring of
        the same ranks whose tally is its own (no step's figures). Collective over the ring."""
        probe = Ring(self.ranks, Tally())
        k = torch.zeros(shape, dtype=dtype, device=device)
        g = torch.zeros(shape, dtype=grad_dtype, device=device)
        start = time.perf_counter()
        for tensors, hops in (([k, k], 2 * (self.size - 1)), ([g, g], self.size - 1)):
            for _ in range(hops):
                probe.post(tensors, tag=73).wait()
        return time.perf_counter() - start


class Posted:
    def __init__(self, works, recv: torch.Tensor, shapes: list, tally: Tally):
        self.works, self.recv, self.shapes, self.tally = works, recv, shapes, tally

    def wait(self) -> list[torch.Tensor]:
        start = time.perf_counter()
        for work in self.works:
            work.wait()
        self.tally.exposed_s += time.perf_counter() - start
        out, at = [], 0
        for shape in self.shapes:
            n = shape.numel()
            out.append(self.recv[at:at + n].view(shape))
            at += n
        return out
