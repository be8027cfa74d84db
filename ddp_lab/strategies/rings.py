"""Reduce-scatter, all-gather and broadcast as bandwidth-optimal rings over gloo's point-to-point, for every
process group.

Why: gloo's reduce-scatter is built from an all-reduce (it moves an all-reduce's bytes and more: 43% of
an emulated 1 Gbit/s link in bus bandwidth, where a ring reaches the link), so on gloo every sharded
strategy (zero1, zero2, fsdp, hsdp, FSDP2) measured gloo's shortcut, not ZeRO. A ring moves
(n-1)/n of the message over each rank's outgoing link, what NCCL's rings move on a GPU cluster.

The algorithms (n ranks in the group, ranks in ring order r -> r+1; rows may differ in size):
- reduce-scatter: at step s = 0..n-2 rank r sends its partial sum of row (r-s-1) to r+1 and receives
  row (r-s-2) from r-1, adding its own contribution; after n-1 steps row r holds every rank's sum.
  The sum runs in the tensor's dtype (bf16 and fp16 sum in that dtype, as gloo's do); the order of
  the sum differs from gloo's, so results agree to that dtype's rounding (bit for bit at 2 ranks,
  where a + b = b + a). The input is not written: partial sums live in row-sized receive buffers, at
  most two at a time (the one arriving and the one being sent on).
- all-gather: rank r's row is written into the output; at step s rank r sends row (r-s) onwards and
  receives row (r-s-1) straight into the output.
- broadcasts (`ring_broadcasts`: many tensors, each from its own source, as zero1's owners send their
  updated parameters): each tensor travels a chain from its source along the ring, src -> src+1 -> ...
  -> src-1, every rank forwarding each piece as it lands, nearest source first (an all-gather of the
  owners' tensors: each rank's link carries what it does not own, (n-1)/n of them all when they are
  spread evenly). Gloo's broadcast sends the whole tensor from the source to every other rank, so the
  source's link carries n-1 copies (2 emulated nodes x 2 ranks, 1 Gbit/s, 16 MiB: 47% of the link in
  bus bandwidth); a chain crosses each link once.
- two-level all-reduce (`ring_two_level_all_reduce`, what NCCL's trees and NVLS-tree do across nodes):
  a ring reduce-scatter inside a node's group, gloo's all-reduce of each rank's row with the ranks
  holding the same row on the other nodes, a ring all-gather inside the node. A flat ring over every
  rank crosses a node's link with 2(N-1)/N of the message; here the link carries the rows of the
  node's k ranks, each all-reduced over G nodes: k x 2(G-1)/G x 1/k = 2(G-1)/G of the message (2 nodes
  x 2 ranks: 1 against 1.5, 1.5x fewer bytes).
Each row travels in pieces (`PIECE_BYTES`), each sent onwards as soon as it arrived and was summed,
so a large message streams through the ring instead of waiting at every step. Where every piece has a
place of its own (the all-gather's output, the broadcasts' tensors), every receive is posted before the
first send, so no piece waits for its receive: on 2 emulated nodes (one rank each) that took a 16 MiB
all-gather from 91 to 76-79 ms at 1 Gbit/s (74% to 85-89% of the link in bus bandwidth) and from 1068 to
716 ms at 0.1 Gbit/s (63% to 94%).

Async as the strategies need it: every process group has one worker thread (a "stream", as NCCL's
one stream per communicator) that runs its rings in launch order, so every rank runs the same
sequence; `async_op=True` returns a `Work` made from a future the worker completes (or fails), which
`wait()`, `get_future()` and FSDP2's `isinstance(work, Work)` all understand. The worker's waits use
the process group's timeout: a rank that dies mid-ring fails its peers' waits, and the failure
reaches the strategy's `wait()`. Nothing is kept between calls: the receive buffers are freed when
the ring ends, and the worker holds no tensor while idle (it would outlive the user's last call).
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

PIECE_BYTES = 1 << 18
"""A row is sent in pieces of at most this many bytes: small enough that a piece moves on while the next
arrives (256 KiB takes 2 ms on a 1 Gbit/s link), large enough that a piece's per-call cost (tens of
microseconds) is small against its transfer. Measured on 2 emulated nodes x 2 ranks at 1 Gbit/s: a 4 MiB
all-gather took 31.7 ms in 256 KiB pieces, 35.1 ms in 1 MiB ones (one piece per row: no pipelining)."""


def row_sizes(total: int, n: int, sizes: list[int] | None) -> list[int]:
    """The n rows' element counts: `sizes` as given, else n equal rows (total must divide)."""
    if sizes is None:
        if total % n:
            raise ValueError(f"{total} elements do not split into {n} equal rows; pass row sizes")
        return [total // n] * n
    if len(sizes) != n or sum(sizes) != total or min(sizes) < 0:
        raise ValueError(f"row sizes {sizes} do not split {total} elements over {n} ranks")
    return list(sizes)


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
                        sizes: list[int] | None = None):
    """Sum `input` (1-D, n rows of `sizes`, equal when None) over the group's ranks; row r lands in `output`
    on group rank r. As `dist.reduce_scatter_single(output, input)` with a SUM."""
    return _run(group, async_op, _reduce_scatter, output, input, sizes)


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
                    sizes: list[int] | None = None):
    """Every rank's `input` concatenated in group-rank order into `output` (1-D, n rows of `sizes`, equal
    when None). As `dist.all_gather_single(output, input)`."""
    return _run(group, async_op, _all_gather, output, input, sizes)


def ring_broadcasts(tensors: list[torch.Tensor], sources: list[int], group=None, async_op: bool = False):
    """Broadcast each of `tensors` (contiguous, any shape) from its group rank in `sources`, in place, in
    list order (every rank passes the same list, its own copies). As one `dist.broadcast` per tensor,
    each a chain along the ring (module docstring); one work for them all when `async_op`."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(tensors) != len(sources) or any(not 0 <= s < n for s in sources):
        raise ValueError(f"one source rank in 0..{n - 1} per tensor, got {list(sources)} for {len(tensors)} tensors")
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("a ring broadcast sends contiguous tensors only")
    peers = _neighbours(group, rank, n)
    flats = [t.view(-1) for t in tensors]
    return _submit(group, async_op, _Job(_broadcasts, flats, list(sources), rank, n, peers, group))


# --- the worker: one thread per process group, rings in launch order --------------------------------

_workers: dict[int, _Worker] = {}
_workers_lock = threading.Lock()


class _Worker:
    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="ddp_lab-ring", daemon=True)
        self.thread.start()

    def submit(self, job) -> torch.futures.Future:
        future = torch.futures.Future()
        self.jobs.put((job, future))
        return future

    def _serve(self) -> None:
        torch.set_grad_enabled(False)  # rings move data only; a caller's views made under no_grad (a TP layer's
        # autograd forward) may not be written where grad mode is on, and grad mode is per thread
        while True:
            job, future = self.jobs.get()
            try:
                result = job()
            except Exception as exc:  # noqa: BLE001 - handed to whoever waits, with its own traceback
                del job
                future.set_exception(exc)
            else:
                del job  # hold no tensor while idle
                future.set_result(result)
                del result
            del future


def _worker(group) -> _Worker:
    """The group's worker. Keyed by the group object's id: a group made after another was destroyed may
    reuse its id, and its worker, which is harmless (a worker keeps no state of a group between rings)."""
    key = id(group if group is not None else dist.group.WORLD)
    with _workers_lock:
        if key not in _workers:
            _workers[key] = _Worker()
        return _workers[key]


def ring_two_level_all_reduce(tensor: torch.Tensor, node_group, across_group, async_op: bool = False):
    """SUM all-reduce of `tensor` (1-D, its length a multiple of the node group's size) in place, in two
    levels (module docstring): `node_group` holds this rank's node, `across_group` the ranks at the same
    place in every node. Runs on the node group's worker, in order with its other rings."""
    k, rank = dist.get_world_size(node_group), dist.get_rank(node_group)
    if tensor.numel() % k or not tensor.is_contiguous():
        raise ValueError(f"a two-level all-reduce needs a contiguous tensor whose length divides by {k}")
    flat = tensor.view(-1)
    peers = _neighbours(node_group, rank, k)
    rows = [flat.numel() // k] * k
    return _submit(node_group, async_op, _Job(_two_levels, flat, rows, rank, k, peers, node_group, across_group))


def _two_levels(flat, rows, rank, k, peers, node_group, across_group) -> None:
    mine = torch.empty(rows[rank], dtype=flat.dtype, device=flat.device)
    _reduce_scatter(mine, flat, rows, rank, k, peers, node_group)
    dist.all_reduce(mine, group=across_group)  # gloo's ring, across nodes: 1/k of the message
    _all_gather(flat, mine, rows, rank, k, peers, node_group)


def _submit(group, async_op: bool, job):
    future = _worker(group).submit(job)
    if not async_op:
        future.wait()
        return None
    return work_from_future(future)


def _run(group, async_op: bool, algorithm, output: torch.Tensor, input: torch.Tensor, sizes):
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = row_sizes(output.numel() if algorithm is _all_gather else input.numel(), n, sizes)
    mine = input if algorithm is _all_gather else output
    if mine.numel() != rows[rank] or not (output.is_contiguous() and input.is_contiguous()):
        raise ValueError(f"rank {rank}'s row has {rows[rank]} elements, got {mine.numel()} (contiguous tensors only)")
    if output.dtype != input.dtype:
        raise ValueError(f"output is {output.dtype}, input {input.dtype}: a ring sends one dtype")
    peers = _neighbours(group, rank, n)
    return _submit(group, async_op, _Job(algorithm, output.view(-1), input.view(-1), rows, rank, n, peers, group))


def work_from_future(future: torch.futures.Future) -> dist.Work:
    """A `Work` that completes with `future`, so callers that check `isinstance(work, Work)` (FSDP2) or
    call `wait()`/`get_future()` take it. Not torch's `_create_work_from_future`: its `wait()` returns
    True when the future failed (torch 2.13), which would let a ring whose peer died hand back garbage."""
    return _FutureWork(future)


class _FutureWork(dist.Work):
    def __init__(self, future: torch.futures.Future):
        super().__init__()
        self.future = future

    def wait(self, timeout=None) -> bool:
        self.future.wait()  # raises the ring's error
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return self.future.done()


def global_rank(group, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (None: the default group), as point-to-point calls take it."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _neighbours(group, rank: int, n: int) -> tuple[int, int]:
    """(right, left): the global ranks this group rank sends to and receives from round the ring."""
    return global_rank(group, (rank + 1) % n), global_rank(group, (rank - 1) % n)


class _Job:
    """One ring (`algorithm(*args)`), run on the worker thread; its tensors dropped when it ends."""

    def __init__(self, algorithm, *args):
        self.algorithm, self.args = algorithm, args

    def __call__(self):
        args, self.args = self.args, None
        self.algorithm(*args)


def _pieces(length: int, element_size: int) -> list[tuple[int, int]]:
    step = max(1, PIECE_BYTES // element_size)
    return [(lo, min(lo + step, length)) for lo in range(0, length, step)]


def _offsets(rows: list[int]) -> list[int]:
    out, at = [], 0
    for size in rows:
        out.append(at)
        at += size
    return out


def _reduce_scatter(output, input, rows, rank, n, peers, group) -> None:
    if n == 1:
        output.copy_(input)
        return
    right, left = peers
    at, size = _offsets(rows), input.element_size()

    def own(index):
        return input[at[index]:at[index] + rows[index]]

    # step 0 sends this rank's row r-1 as it is; each later step forwards, piece by piece, what the step
    # before received once this rank's own part is added, so a piece moves on as soon as it is summed
    arrived, sends = None, []
    for step in range(n - 1):
        target = (rank - step - 2) % n
        buffer = output if step == n - 2 else torch.empty(rows[target], dtype=input.dtype, device=input.device)
        posted = [(lo, hi, dist.irecv(buffer[lo:hi], src=left, group=group)) for lo, hi in _pieces(rows[target], size)]
        if arrived is None:
            sending = own((rank - 1) % n)
            forwarded = [dist.isend(sending[lo:hi], dst=right, group=group)
                         for lo, hi in _pieces(sending.numel(), size)]
        else:
            forwarded = _sum_and_forward(arrived, right, group)
        for work in sends:  # the step before's sends: their buffer is free once they are out
            work.wait()
        arrived, sends = (buffer, own(target), posted), forwarded
    _sum_and_forward(arrived, None, group)
    for work in sends:
        work.wait()


def _sum_and_forward(arrived, right, group) -> list:
    """Wait for each piece of a row, add this rank's part, and send it on to `right` (None: keep it)."""
    buffer, mine, posted = arrived
    sends = []
    for lo, hi, work in posted:
        work.wait()
        buffer[lo:hi].add_(mine[lo:hi])
        if right is not None:
            sends.append(dist.isend(buffer[lo:hi], dst=right, group=group))
    return sends


def _all_gather(output, input, rows, rank, n, peers, group) -> None:
    at = _offsets(rows)
    output[at[rank]:at[rank] + rows[rank]].copy_(input)
    if n == 1:
        return
    right, left = peers
    size = input.element_size()

    def row(index):
        index %= n
        return output[at[index]:at[index] + rows[index]]

    # every receive is posted before the first send (each row lands in its own place of the output, so
    # all can wait at once): a piece never arrives before its receive is ready
    arrivals = [(step, row(rank - step - 1)) for step in range(n - 1)]
    posted = [[(lo, hi, dist.irecv(arriving[lo:hi], src=left, group=group))
               for lo, hi in _pieces(arriving.numel(), size)] for _, arriving in arrivals]
    sending = row(rank)
    sends = [dist.isend(sending[lo:hi], dst=right, group=group) for lo, hi in _pieces(sending.numel(), size)]
    for (step, arriving), works in zip(arrivals, posted):
        for lo, hi, work in works:
            work.wait()
            if step < n - 2:  # forward each piece as it lands: the last row received goes no further
                sends.append(dist.isend(arriving[lo:hi], dst=right, group=group))
    for work in sends:
        work.wait()


def _broadcasts(tensors, sources, rank, n, peers, group) -> None:
    if n == 1:
        return
    right, left = peers
    sends = []
    # nearest source first: this rank's own tensors, then its left neighbour's, ... (as the all-gather's
    # rows): every link is busy at once, and what a rank sends on is what its right neighbour receives
    # next, since the neighbour's order is the same shifted by one
    order = sorted(range(len(tensors)), key=lambda i: ((rank - sources[i]) % n, i))
    # every receive posted before the first send, as the all-gather's (each tensor is its own buffer)
    posted = {i: [(lo, hi, dist.irecv(tensors[i][lo:hi], src=left, group=group))
                  for lo, hi in _pieces(tensors[i].numel(), tensors[i].element_size())]
              for i in order if sources[i] != rank}
    for i in order:
        tensor, source = tensors[i], sources[i]
        if rank == source:
            sends += [dist.isend(tensor[lo:hi], dst=right, group=group)
                      for lo, hi in _pieces(tensor.numel(), tensor.element_size())]
            continue
        forward = (rank + 1) % n != source  # the chain ends at the source's left neighbour
        for lo, hi, work in posted.pop(i):
            work.wait()
            if forward:
                sends.append(dist.isend(tensor[lo:hi], dst=right, group=group))
    for work in sends:
        work.wait()
