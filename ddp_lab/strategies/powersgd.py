"""`strategy=powersgd`: PowerSGD (Vogels, Karimireddy and Jaggi, 2019), low-rank gradient compression.

Each gradient matrix M (n x m; a tensor of 3 or more dimensions is read as shape[0] x the rest) is
sent as two thin factors instead of itself: one step of power iteration finds an orthonormal
P (n x r) whose span holds most of M's energy, and every rank receives P Q^T ~ the rank average of
M, with Q = M^T P (m x r). r = min(`rank`, n, m). Per matrix the ranks move (n + m) r numbers
instead of n m: for the tiny Transformer at rank 4 about 2% of its gradient bytes.

Per bucket (BucketedDDP's plan, `bucket_mb`), launched from backward as the bucket fills, like
bucketed, and in three phases, every rank issuing the same collectives in the same order:

1. add this rank's error (below) to each matrix, P = M Q with last step's Q (warm start, the
   paper's "reuse": one power-iteration step per training step keeps refining the same subspace;
   Q is orthonormalized first, as torch's hook does, so a matrix whose gradient was zero for a
   step recovers instead of keeping a zero Q); one all-reduce of [the bucket's uncompressed
   tensors / N, every P] (a P's scale does not matter: it is orthonormalized next);
2. started when the *next* bucket's phase 1 has been launched (so its P's all-reduce was in flight
   meanwhile) or, for the last bucket, by `finish_gradient_synchronization()`: orthonormalize
   each summed P (QR), Q = M^T P / N, one all-reduce of every Q;
3. in `finish_gradient_synchronization()`: M's average is P Q^T, written into the gradient, and
   the error M - P Q^T (M including last step's error) is kept for the next step (error feedback:
   what compression dropped is sent later instead of lost; torch's hook and the paper's code keep
   the same quantity). Gradients under fp16 loss scaling carry the scale S (`grad_scale`): the
   error is kept divided by S and added back times the next step's S, so a scale that backs off
   or grows never reweights it.

Not compressed, sent exactly in the phase-1 all-reduce: 1-D tensors (biases, norm weights: small,
and a rank-r vector is no saving) and matrices where (n + m) r >= n m, where the factors would be
as big as the matrix. A bucket with nothing to compress is one plain all-reduce, as in bucketed.
The first `start_iter` synchronizations are plain all-reduces of every bucket: early gradients
change fast and a warm-started Q has nothing to refine yet; torch's hook defers compression the
same way (`start_powerSGD_iter`).

A step whose gradient overflowed (inf or NaN, which fp16 loss scaling produces and then skips)
shows as a non-finite value in what was all-reduced (an inf anywhere in M makes P = M Q non-finite),
the same on every rank: the delivered gradient is non-finite (so the scaler skips the step) and
every bucket's error and Q are left as they were before the step, as if it had not happened.

The initial Q (at the first compressed step) is drawn from a generator seeded the same on every
rank, so ranks agree; after that Q is an all-reduce result, identical everywhere, and so is the
delivered gradient. Time is counted as for every strategy (comm_stats.py): waiting for a bucket's
P inside backward (phase 2) is exposed comm, and the arithmetic of all three phases (the matrix
products, QR and packing) is `compress_ms`, compute, never comm. `comm_dtype` (bf16, fp16) sends
the P's, Q's, uncompressed tensors and plain steps in that dtype (a cast copy; the factors are
computed in fp32). `facts()["powersgd"]` records the plan and the compression ratio; `comm_bytes`
counts what is really sent each step (plain steps: the whole gradient; compressed: P's, Q's and
the uncompressed tensors).

Why our own: torch's powerSGD_hook waits on a second collective inside the first one's future
callback, which on gloo runs on the thread that completes collectives, so it hangs until the
timeout (design.md). Here every wait is on the main thread.
"""

from __future__ import annotations

import torch
from torch import nn

from ddp_lab.arithmetic.buckets import DEFAULT_BUCKET_MB
from ddp_lab.strategies.bucketed import BucketedDDP
from ddp_lab.strategies.collectives import all_reduce_sum_async
from ddp_lab.strategies.comm_stats import Stamp, record_intervals

Q_SEED = 20190531  # the initial Q's seed: any number, the same on every rank


def orthonormalize_(matrix: torch.Tensor) -> torch.Tensor:
    """Replace the columns of `matrix` (n x r, r <= n) by an orthonormal basis of their span (reduced
    QR; a rank-deficient or zero matrix still gets r orthonormal columns)."""
    q, _ = torch.linalg.qr(matrix)
    return matrix.copy_(q)


# One compressed matrix M (n x m) through the three phases, with its factors P (n x r), Q (m x r) and its
# error (n x m). The strategy runs them on views into its buckets; the profiler times them
# (rank/host_timing.py) for the step-time predictor.

def compress_p_(matrix, p, q, error, grad_scale: float = 1.0) -> None:
    """Phase 1: the kept error (unscaled) added into M, then P = M Q with Q orthonormalized."""
    matrix.add_(error, alpha=grad_scale)
    torch.mm(matrix, orthonormalize_(q), out=p)


def compress_q_(matrix, p, q) -> None:
    """Phase 2, once P is summed over ranks: Q = M^T P with P orthonormalized."""
    torch.mm(matrix.t(), orthonormalize_(p), out=q)


def decompress_(matrix, p, q, error, keep_error: bool = True, grad_scale: float = 1.0) -> None:
    """Phase 3: M = P Q^T, and (unless the step overflowed) the error M - P Q^T kept, divided by the scale."""
    if keep_error:
        error.copy_(matrix)
    torch.mm(p, q.t(), out=matrix)  # non-finite when overflowed: the scaler skips the step
    if keep_error:
        error.sub_(matrix)
        if grad_scale != 1.0:
            error.div_(grad_scale)


class _Matrix:
    """One compressed gradient: its n x m view into the bucket and its rank."""

    __slots__ = ("param", "n", "m", "r")

    def __init__(self, param: nn.Parameter, rank: int):
        self.param = param
        self.n = param.shape[0]
        self.m = param.numel() // self.n
        self.r = min(rank, self.n, self.m)


class PowerSGD(BucketedDDP):
    """PowerSGD behind the strategy contract (module docstring): `PowerSGD(module, bucket_mb=25, rank=1,
    start_iter=10, comm_dtype="fp32")`."""

    min_compression_rate = 1.0
    """A matrix is compressed when n m > min_compression_rate (n + m) r: 1 whenever that sends fewer
    numbers (torch's hook defaults to 2); 0 compresses every matrix (the exactness tests)."""

    def __init__(self, module: nn.Module, bucket_mb: float = DEFAULT_BUCKET_MB, rank: int = 1, start_iter: int = 10,
                 comm_dtype: str = "fp32", process_group=None):
        if not (isinstance(rank, int) and rank >= 1):
            raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
        if not (isinstance(start_iter, int) and start_iter >= 0):
            raise ValueError(f"start_iter must be an integer >= 0, got {start_iter!r}")
        super().__init__(module, bucket_mb, comm_dtype, process_group=process_group)
        self.rank, self.start_iter = rank, start_iter
        self.syncs = 0  # finished synchronizations: compression starts at start_iter
        self._matrices: list[list[_Matrix]] = []
        self._plain: list[list[nn.Parameter]] = []
        for unit in self._units:
            matrices = [_Matrix(p, rank) for p in unit if p.dim() >= 2]
            matrices = [x for x in matrices if x.n * x.m > self.min_compression_rate * (x.n + x.m) * x.r]
            compressed = {id(x.param) for x in matrices}
            self._matrices.append(matrices)
            self._plain.append([p for p in unit if id(p) not in compressed] if matrices else [])
        self._q: list[torch.Tensor | None] = [None] * len(self._units)       # warm-start Qs, flat per bucket
        self._errors: list[torch.Tensor | None] = [None] * len(self._units)  # error feedback, flat per bucket
        self._send: list[torch.Tensor | None] = [None] * len(self._units)    # [plain / N, P's] per bucket

    # --- the plan and what it sends ------------------------------------------------------------

    def _plain_numel(self, index: int) -> int:
        return sum(p.numel() for p in self._plain[index])

    def _wire_size(self, index: int) -> int:
        """Bytes per number bucket `index` sends: comm_dtype's, or the gradients' own."""
        like = self._units[index][0]
        return like.element_size() if self.wire_dtype is None else torch.empty((), dtype=self.wire_dtype).element_size()

    def compressed_bytes(self, index: int) -> int:
        """Bytes bucket `index` sends per compressed step (the bucket itself when nothing in it compresses)."""
        if not self._matrices[index]:
            return self._lengths[index] * self._wire_size(index)
        numbers = self._plain_numel(index) + sum((x.n + x.m) * x.r for x in self._matrices[index])
        return numbers * self._wire_size(index)

    def facts(self) -> dict:
        full = sum(n * self._wire_size(i) for i, n in enumerate(self._lengths))
        compressed = sum(self.compressed_bytes(i) for i in range(len(self._units)))
        matrices = [x for unit in self._matrices for x in unit]
        return {**super().facts(), "powersgd": {
            "rank": self.rank, "start_iter": self.start_iter,
            "matrices_compressed": len(matrices),
            "tensors_plain": sum(len(unit) for unit in self._units) - len(matrices),
            "bytes_plain_step": full, "bytes_compressed_step": compressed,
            "compression_ratio": full / compressed if compressed else None}}

    def kept_tensors(self) -> list[torch.Tensor]:
        """The buckets, and per compressed bucket its error feedback, warm-start Q and send buffer."""
        kept = [t for tensors in (self._errors, self._q, self._send) for t in tensors if t is not None]
        return super().kept_tensors() + kept

    def checkpoint_rank_state(self) -> dict[str, torch.Tensor]:
        """The synchronizations so far, and per compressed bucket its error feedback (this rank's own) and
        warm-start Q."""
        state = {"powersgd.syncs": torch.tensor([self.syncs], dtype=torch.int64)}
        for index, (error, q) in enumerate(zip(self._errors, self._q)):
            if error is not None:
                state[f"powersgd.error.{index}"], state[f"powersgd.q.{index}"] = error, q
        return state

    @torch.no_grad()
    def load_rank_state(self, state: dict[str, torch.Tensor]) -> bool:
        """Errors and Q's as this rank saved them, where the plan is the same (bucket sizes, ranks); else
        afresh: no error, no Q, and the first `start_iter` synchronizations plain again."""
        self._errors, self._q = [None] * len(self._units), [None] * len(self._units)
        saved = {int(key.rsplit(".", 1)[1]) for key in state if key.startswith("powersgd.error.")}

        def fits_bucket(index: int) -> bool:
            matrices = self._matrices[index] if index < len(self._units) else []
            q = state.get(f"powersgd.q.{index}", torch.empty(0))
            return bool(matrices) and state[f"powersgd.error.{index}"].numel() == sum(x.n * x.m for x in matrices) \
                and q.numel() == sum(x.m * x.r for x in matrices)

        fits = "powersgd.syncs" in state and all(fits_bucket(index) for index in saved)
        if not fits:
            self.syncs = 0
            return False
        self.syncs = int(state["powersgd.syncs"].item())
        for index in saved:
            self._allocate(index)
            self._errors[index].copy_(state[f"powersgd.error.{index}"])
            self._q[index].copy_(state[f"powersgd.q.{index}"])
        return True

    # --- phase 1: error feedback, P = M Q, all-reduce [plain / N, P] ---------------------------------

    @property
    def compressing(self) -> bool:
        return self.syncs >= self.start_iter

    def _launch_unit(self, index: int) -> tuple[torch.futures.Future, Stamp]:
        if self.compressing and self._matrices[index]:
            launched = self._launch_p(index)
        else:
            launched = super()._launch_unit(index)  # bucketed's plain mean all-reduce
        self._launch_qs(upto=index)  # earlier buckets' P's were in flight while this one filled
        return launched

    def _views(self, index: int):
        """(M, P, Q, error): views of each compressed matrix of bucket `index` and its factors and error."""
        send, q, errors = self._send[index], self._q[index], self._errors[index]
        p_at, q_at, e_at = self._plain_numel(index), 0, 0
        for x in self._matrices[index]:
            yield (self._view_of[id(x.param)].view(x.n, x.m), send[p_at:p_at + x.n * x.r].view(x.n, x.r),
                   q[q_at:q_at + x.m * x.r].view(x.m, x.r), errors[e_at:e_at + x.n * x.m].view(x.n, x.m))
            p_at, q_at, e_at = p_at + x.n * x.r, q_at + x.m * x.r, e_at + x.n * x.m

    def _allocate(self, index: int) -> None:
        """A bucket's first compressed step: zero errors, a send buffer, and the same random Q on every rank."""
        like = self._units[index][0]
        matrices = self._matrices[index]

        def zeros(n):
            return torch.zeros(n, dtype=like.dtype, device=like.device)

        self._errors[index] = zeros(sum(x.n * x.m for x in matrices))
        self._send[index] = zeros(self._plain_numel(index) + sum(x.n * x.r for x in matrices))
        generator = torch.Generator().manual_seed(Q_SEED + index)
        q = torch.randn(sum(x.m * x.r for x in matrices), generator=generator, dtype=like.dtype)
        self._q[index] = q.to(like.device)

    @torch.no_grad()
    def _launch_p(self, index: int) -> tuple[torch.futures.Future, Stamp]:
        with self.comm.arithmetic():
            if self._q[index] is None:
                self._allocate(index)
            self._q_before[index] = self._q[index].clone()  # restored if the step overflows
            send, at = self._send[index], 0
            for param in self._plain[index]:
                send[at:at + param.numel()].copy_(self._view_of[id(param)].reshape(-1))
                at += param.numel()
            send[:at].div_(self.world_size)
            for matrix, p, q, error in self._views(index):
                compress_p_(matrix, p, q, error, self.grad_scale)
        self._pending_q.append(index)
        return self._all_reduce(send)

    def _all_reduce(self, tensor: torch.Tensor) -> tuple[torch.futures.Future, Stamp]:
        return all_reduce_sum_async(tensor, self.wire_dtype, group=self.process_group)

    # --- phase 2: P's summed: orthonormalize, Q = M^T P / N, all-reduce the Q's -------------------------

    @torch.no_grad()
    def _launch_qs(self, upto: int) -> None:
        """Phase 2 for every bucket before `upto` whose P's were launched, in bucket order."""
        while self._pending_q and self._pending_q[0] < upto:
            index = self._pending_q.pop(0)
            with self.comm.waited():
                self._p_future[index].wait()
            with self.comm.arithmetic():
                send, at = self._send[index], 0
                for param in self._plain[index]:
                    self._view_of[id(param)].copy_(send[at:at + param.numel()].view_as(param))
                    at += param.numel()
                for matrix, p, q, _ in self._views(index):
                    compress_q_(matrix, p, q)
                q = self._q[index].div_(self.world_size)
            self._q_in_flight.append((index, *self._all_reduce(q)))

    def _launch_next(self) -> None:
        index = self._next_unit
        super()._launch_next()
        self._p_future[index] = self._in_flight[-1][0]

    # --- phase 3: the average P Q^T into the gradient, the error kept ----------------------------------

    @torch.no_grad()
    def _synchronize_gradients(self) -> None:
        while self._next_unit < len(self._units):
            self._launch_next()
        self._launch_qs(upto=len(self._units))
        for future, _ in self._in_flight:
            future.wait()
        for _, future, _ in self._q_in_flight:
            future.wait()
        overflowed = not self._all_finite()
        with self.comm.arithmetic():
            for index, *_ in self._q_in_flight:
                for matrix, p, q, error in self._views(index):
                    decompress_(matrix, p, q, error, keep_error=not overflowed, grad_scale=self.grad_scale)
                if overflowed:
                    self._q[index].copy_(self._q_before[index])
        record_intervals([stamp for *_, stamp in self._q_in_flight], self.comm)
        super()._synchronize_gradients()  # waits and records the phase-1 / plain all-reduces, starts a round
        self.syncs += 1

    def _all_finite(self) -> bool:
        """Whether everything this step's all-reduces delivered is finite (the same answer on every
        rank): each compressed bucket's [plain, P] and Q; under loss scaling also the plain buckets."""
        compressed = {index for index, *_ in self._q_in_flight}
        sent = [t for index in compressed for t in (self._send[index], self._q[index])]
        if self.grad_scale != 1.0:
            sent += [self._bucket(i) for i in range(len(self._units)) if i not in compressed]
        return bool(torch.stack([t.isfinite().all() for t in sent]).all()) if sent else True

    def _start_round(self) -> None:
        super()._start_round()
        self._q_before: dict[int, torch.Tensor] = {}  # each compressed bucket's Q before this step
        self._pending_q: list[int] = []  # buckets whose P's are launched and Q's not yet
        self._p_future: dict[int, torch.futures.Future] = {}
        self._q_in_flight: list[tuple[int, torch.futures.Future, Stamp]] = []
