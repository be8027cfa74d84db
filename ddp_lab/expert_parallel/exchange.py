"""The tokens' trip to their experts and back, written by hand: counts first, rows by `all_to_all_single` inside an
autograd Function of the lab's own, the rank-major rows put expert-major for the experts and back.

A rank's rows arrive sorted by global expert (models/moe.py); expert e lives on ep rank e // (experts / ep). So:

1. the counts are exchanged first (one all-to-all of `experts` integers): each rank learns how many rows every
   other rank sends to each of its experts, so every receive buffer is sized exactly (gloo kills a rank that
   receives more rows than it expected, with no Python exception, and leaves rows uninitialized when it receives
   fewer);
2. dispatch: the rows go to their experts' ranks (`AllToAll`, its backward the reverse exchange of the gradient);
3. what arrives is rank-major (source 0's rows for my experts 0, 1, ..., then source 1's); a permutation puts it
   expert-major, the experts run, and its inverse puts the outputs back rank-major;
4. combine: the outputs go back to the ranks that own the tokens (`AllToAll` again), in the order they came from.

`Tally` counts the bytes each rank sends to the others (its own rows never leave it) per direction and pass, and
the time inside the all-to-alls, which here block the rank (nothing computes meanwhile): all of it is exposed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ddp_lab.spec.figures import EP_BYTES, EP_EXCHANGE, EP_PARTS


@dataclass
class Tally:
    """One rank's expert-parallel figures since the last `pop()`: bytes it sent to the other ep ranks by
    (dispatch or combine, forward or backward), and seconds inside the all-to-alls."""

    sent: dict = field(default_factory=dict)
    seconds: float = 0.0
    rows: int = 0
    """Rows this rank's experts took in since the run began (every rank's tokens routed to them), in training forwards
    (not the held-out loss's): which rank holds the busiest experts (`ExpertParallel.describe`)."""

    def add(self, what: str, nbytes: int) -> None:
        self.sent[what] = self.sent.get(what, 0) + nbytes

    def pop(self) -> dict:
        out = {EP_BYTES.key: sum(self.sent.values()), EP_EXCHANGE.key: self.seconds * 1e3,
               **{part.key: self.sent.get(part.key.removeprefix(f"{EP_BYTES.key}_"), 0) for part in EP_PARTS}}
        self.sent, self.seconds = {}, 0.0
        return out


def row_bytes(x: torch.Tensor) -> int:
    """The bytes of one row of `x` (which may have none: a rank whose experts no token chose)."""
    return math.prod(x.shape[1:]) * x.element_size()


def _exchange(x: torch.Tensor, send: list[int], receive: list[int], group, tally: Tally, what: str) -> torch.Tensor:
    """Rows `send[r]` of `x` to ep rank r, `receive[r]` rows from it into a buffer sized exactly; its bytes to the
    others counted as `what`."""
    out = x.new_empty((sum(receive), *x.shape[1:]))
    start = time.perf_counter()
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=receive, input_split_sizes=send, group=group)
    tally.seconds += time.perf_counter() - start
    me = dist.get_rank(group)
    tally.add(what, (sum(send) - send[me]) * row_bytes(x))
    return out


class AllToAll(torch.autograd.Function):
    """`_exchange` forward; backward, the gradient of each received row sent back to the rank it came from."""

    @staticmethod
    def forward(ctx, x, send: list[int], receive: list[int], group, tally: Tally, what: str):
        ctx.send, ctx.receive, ctx.group, ctx.tally, ctx.what = send, receive, group, tally, what
        return _exchange(x, send, receive, group, tally, f"{what}_forward")

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.receive, ctx.send, ctx.group, ctx.tally, f"{ctx.what}_backward"), None, None, \
            None, None, None


def exchange_counts(counts: torch.Tensor, ep: int, group, tally: Tally) -> torch.Tensor:
    """(ep, local experts): how many rows each ep rank sends to each of this rank's experts, from every rank's
    `counts` (rows per global expert); its time in `tally`'s (its bytes, a few integers, are not counted)."""
    received = torch.empty_like(counts)
    start = time.perf_counter()
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    tally.seconds += time.perf_counter() - start
    return received.view(ep, -1)


def expert_major(received: torch.Tensor) -> torch.Tensor:
    """The permutation taking rank-major rows (source r's rows for expert 0, 1, ... then source r + 1's) to
    expert-major ones (expert 0's rows from source 0, 1, ..., then expert 1's): indices into the received rows."""
    sizes = received.flatten()
    starts = torch.cumsum(sizes, 0) - sizes
    ep, local = received.shape
    return torch.cat([torch.arange(int(starts[r * local + e]), int(starts[r * local + e] + sizes[r * local + e]))
                      for e in range(local) for r in range(ep)] or [torch.zeros(0, dtype=torch.long)])


class LabExchange:
    """`exchange(rows sorted by expert, count per global expert, this rank's experts)` over an ep group, by hand. The
    trip is `__call__`'s; how rows are sent (`_send`) and how the experts run (`_run`) are what torch's parts replace
    (torch_exchange.py)."""

    def __init__(self, ep: int, group, tally: Tally):
        self.ep, self.group, self.tally = ep, group, tally

    @torch.compiler.disable  # under train.compile a graph break: data-dependent shapes, run eager and timed
    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts) -> torch.Tensor:
        received = exchange_counts(counts, self.ep, self.group, self.tally)
        send = counts.view(self.ep, -1).sum(1).tolist()
        receive = received.sum(1).tolist()
        self.tally.rows += sum(receive) if torch.is_grad_enabled() else 0  # training forwards only
        arrived = self._send(x, send, receive, "dispatch")
        order = expert_major(received).to(x.device)
        out = self._run(arrived[order], received.sum(0).tolist(), experts)
        back = out[torch.argsort(order)]  # the inverse permutation: rank-major again
        return self._send(back, receive, send, "combine")

    def _send(self, x: torch.Tensor, send: list[int], receive: list[int], what: str) -> torch.Tensor:
        return AllToAll.apply(x, send, receive, self.group, self.tally, what)

    def _run(self, x: torch.Tensor, counts: list[int], experts) -> torch.Tensor:
        """The experts over rows grouped by expert: their own loop (any dtype)."""
        return experts(x, counts)
