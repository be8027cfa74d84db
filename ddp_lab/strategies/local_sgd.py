"""`strategy=local_sgd`: no gradient communication; parameters averaged every `sync_every` steps.

Each rank steps its own optimizer on its own gradients (`finish_gradient_synchronization()` does
nothing), so between synchronizations the ranks' models drift apart. After every `sync_every`-th
`optimizer.step()` the trainable parameters and the persistent floating-point buffers (running
statistics) are averaged over ranks with one all-reduce, and every rank continues from the
average: parameter averaging, the alternative to gradient averaging (local SGD, Stich 2019;
Lin et al. 2020). With `sync_every=1` and plain SGD this *is* data parallelism: the mean of
θ - lr g_k is θ - lr mean(g_k). Each rank keeps its own optimizer state (Adam's moments are not
averaged, as in DiLoCo's inner optimizer).

`outer=nesterov` (DiLoCo, Douillard et al. 2023): the averaged change is treated as a gradient
for an outer optimizer instead of being taken as is. With θ the parameters at the last
synchronization and θ̄ the rank average now, the pseudo-gradient Δ = θ - θ̄ feeds SGD with
Nesterov momentum (torch's `SGD(nesterov=True)`: b = μ b + Δ, θ ← θ - lr (Δ + μ b)), with
DiLoCo's values lr 0.7 and momentum 0.9 (`OUTER_LR`, `OUTER_MOMENTUM`). `outer=none` is plain
averaging (outer lr 1, no momentum). Buffers are always plainly averaged. The outer state
(θ at the last sync and the momentum b, two copies of the trainable parameters) lives in the
wrapper, not in the optimizer's state.

`fragments=F` (streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512): the trainable parameters are cut, in
`parameters()` order, into F contiguous fragments of about equal bytes, and each fragment is synchronized on
its own step of the round: fragment f (0-based) after every optimizer step t with t ≡ (f+1)·H/F (mod H),
H = `sync_every`, so the last fragment syncs at the round's end as the whole model does with F=1, and the
buffers go with it. Each fragment has its own anchor and outer momentum. The bytes of a round are the
same; the peak per step is one fragment's instead of the whole model's, which is streaming's point.

`delay=τ` (the overlapped outer step: streaming DiLoCo's τ, torchft's `fragment_sync_delay`, with its
schedule): a fragment's all-reduce is launched τ optimizer steps before its sync step and waited for at
it, so it travels behind τ steps of compute. The outer step is taken then on the average of the
parameters *as they were at launch* (its pseudo-gradient Δ = anchor - that average), and the fragment
becomes mix·θ_local + (1 - mix)·θ_global: with `mix=0` (torchft's `fragment_update_alpha` default) the
τ local steps taken meanwhile are dropped for that fragment and every rank holds the same fragment
again; with mix > 0 they are partly kept and the replicas stay apart. τ must be below H (the result must
land before the fragment's next launch: refused otherwise, and so is a delay with sync_every=1). An
in-flight all-reduce is comm of every step it is in flight (`CommStats.carry`); its bytes count in the
step that launched it; the wait at its sync step is exposed.

`outer_topk=k` (SparseLoCo, arXiv 2508.15706; strategies/sparse_outer.py): a sync sends, instead of the
parameters' all-reduce, each rank's pseudo-gradient Δ = anchor - θ with error feedback, cut to the k
largest values of each block and quantized to 2 bits, in one all-gather; the anchor takes the plain
average of what the ranks sent (outer lr 1, no momentum: `outer=nesterov` is refused with it). It works
with fragments and a delay as the all-reduce does. Models with running statistics are refused (a sparse
pseudo-gradient does not carry them), and so are checkpoints (its error feedback is not saved yet).

With F=1 and τ=0 this is exactly the plain local SGD / DiLoCo above (the same code path); with H=1,
plain averaging and a plain SGD inner step it is DDP.

How it fits the strategy contract without the trainer knowing: `make_optimizer` returns the plain
optimizer with a step post-hook (`register_step_post_hook`) that counts steps and averages. The
averaging all-reduce is exposed communication inside the optimizer step (as zero1's broadcasts
are): `comm_bytes` is the whole model's bytes on sync steps and 0 on the others, so a run's mean
per step is 1/sync_every of a gradient all-reduce's.

Bad input: `sync_every` < 1, an unknown `outer`, more fragments than sync steps in a round (or than
trainable parameter tensors), a delay not below `sync_every`, and `mix` outside [0, 1) or without a delay
are refused (its spec, before launch, and here). There is no gradient collective, so `strategy.comm_dtype`
means nothing here (its spec: `reduces_gradients = False`).
"""

from __future__ import annotations

import itertools
import weakref
from contextlib import contextmanager

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddp_lab.strategies.base import DataParallelBase
from ddp_lab.strategies.collectives import all_gather, all_reduce_mean_, all_reduce_mean_async, launch_stamped
from ddp_lab.strategies.sparse_outer import BITS, SparseOuter, gathered_buffer
from ddp_lab.units import tensor_bytes

OUTER_LR = 0.7        # DiLoCo's outer learning rate (Douillard et al. 2023, section 3)
OUTER_MOMENTUM = 0.9  # DiLoCo's Nesterov momentum
OUTERS = ("none", "nesterov")


def averaged_buffers(module: nn.Module) -> list[torch.Tensor]:
    """Persistent floating-point buffers (running statistics), each once. Non-persistent ones (a
    RoPE table) are computed, identical on every rank, and not sent."""
    seen, out = set(), []
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if (buffer is not None and buffer.is_floating_point() and name not in sub._non_persistent_buffers_set
                    and id(buffer) not in seen):
                seen.add(id(buffer))
                out.append(buffer)
    return out


def split_fragments(params: list[nn.Parameter], fragments: int) -> list[list[nn.Parameter]]:
    """`params` in order, cut into `fragments` contiguous runs, each at least one tensor: a run ends at the first
    tensor that brings it to its share of the bytes ((f+1)/fragments of them, counted from the first)."""
    if not 1 <= fragments <= len(params):
        raise ValueError(f"fragments must be in [1, {len(params)}] (the trainable parameter tensors), got {fragments}")
    cumulative = list(itertools.accumulate(tensor_bytes(p) for p in params))
    out, start = [], 0
    for f in range(fragments):
        end = start + 1
        last_start = len(params) - (fragments - f - 1)  # the later fragments need a tensor each
        while end < last_start and (f == fragments - 1 or cumulative[end - 1] < cumulative[-1] * (f + 1) / fragments):
            end += 1
        out.append(params[start:end])
        start = end
    return out


class LocalSGD(DataParallelBase):
    """Local SGD behind the strategy contract (module docstring): `LocalSGD(module, sync_every=4, outer="none",
    fragments=1, delay=0, mix=0.0, outer_topk=None, outer_chunk=64, outer_bits=2, error_decay=0.95)`."""

    def __init__(self, module: nn.Module, sync_every: int = 4, outer: str = "none", fragments: int = 1,
                 delay: int = 0, mix: float = 0.0, outer_topk: int | None = None, outer_chunk: int = 64,
                 outer_bits: int = 2, error_decay: float = 0.95, process_group=None):
        if not (isinstance(sync_every, int) and sync_every >= 1):
            raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")
        if str(outer) not in OUTERS:
            raise ValueError(f"outer must be one of {', '.join(OUTERS)}, got {outer!r}")
        if not (isinstance(fragments, int) and 1 <= fragments <= sync_every):
            raise ValueError(f"fragments must be an integer in [1, sync_every={sync_every}], got {fragments!r}")
        if not (isinstance(delay, int) and 0 <= delay < sync_every):
            raise ValueError(f"delay must be an integer in [0, sync_every={sync_every}), got {delay!r}")
        if not (0.0 <= mix < 1.0 and (delay > 0 or mix == 0.0)):
            raise ValueError(f"mix must be in [0, 1), and 0 without a delay, got {mix!r}")
        if outer_topk is not None and not (str(outer) == "none" and 1 <= outer_topk <= outer_chunk ** 2
                                           and outer_bits in BITS and 0.0 <= error_decay < 1.0):
            raise ValueError(f"outer_topk={outer_topk!r} needs outer=none, 1 <= outer_topk <= outer_chunk², "
                             f"outer_bits in {BITS} and 0 <= error_decay < 1")
        super().__init__(module, process_group=process_group)
        self.sync_every, self.outer, self.delay, self.mix = sync_every, str(outer), delay, float(mix)
        self.steps = 0  # optimizer steps taken
        self._params = self.trainable_parameters()
        self._fragments = split_fragments(self._params, fragments) if self._params else [[]]
        self._phase = [(f + 1) * sync_every // fragments % sync_every for f in range(fragments)]
        self._buffers_averaged = averaged_buffers(module)
        self._pending: list[tuple[int, int, torch.Tensor, object]] = []  # (due step, fragment, flat, future)
        self._outer_optimizer = None
        self._optimizer = None  # a weak reference to the optimizer make_optimizer built
        self._anchors: list[torch.Tensor] = []
        self._sparse = None
        if outer_topk is not None and self._params:
            if self._buffers_averaged:
                raise ValueError("outer_topk: the model has running statistics (persistent buffers), which a sparse "
                                 "pseudo-gradient does not carry")
            self._sparse = [SparseOuter(frag, outer_chunk, outer_topk, outer_bits, error_decay)
                            for frag in self._fragments]
        if (self.outer == "nesterov" or self._sparse) and self._params:
            with torch.no_grad():  # θ at the last sync, per fragment
                self._anchors = [_flatten_dense_tensors([p.detach() for p in frag]).clone()
                                 for frag in self._fragments]
        if self.outer == "nesterov" and self._params:
            self._outer_optimizer = torch.optim.SGD(self._anchors, lr=OUTER_LR, momentum=OUTER_MOMENTUM,
                                                    nesterov=True)

    def kept_tensors(self) -> list[torch.Tensor]:
        """DiLoCo's outer state (θ at the last sync and the outer momentum, per fragment), SparseLoCo's error
        feedback, and the copies of fragments (or payloads) in flight (delay)."""
        in_flight = [flat for _, _, flat, _ in self._pending]
        errors = self._errors()
        momenta = [] if self._outer_optimizer is None else [
            t for s in self._outer_optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return self._anchors + momenta + errors + in_flight

    def finish_gradient_synchronization(self) -> None:
        """Nothing to synchronize: each rank steps on its own gradients."""

    # --- checkpoints: each rank's own model between syncs, and the rank average for any other load ---------

    def _optimizer_state(self) -> list[torch.Tensor]:
        """This rank's optimizer state tensors (AdamW's moments), parameter by parameter; not its step counts,
        which every rank shares."""
        optimizer = self._optimizer() if self._optimizer is not None else None
        if optimizer is None:
            return []
        return [t for p in self._params for key, t in sorted(optimizer.state.get(p, {}).items())
                if torch.is_tensor(t) and key != "step"]

    def _outer_momenta(self) -> list[torch.Tensor]:
        """Each fragment's outer momentum; zeros where it has none yet (SGD's first step makes the same buffer)."""
        state = self._outer_optimizer.state
        return [state.get(a, {}).get("momentum_buffer", torch.zeros_like(a)) for a in self._anchors]

    def checkpoint_rank_state(self) -> dict[str, torch.Tensor]:
        """Steps since the start, this rank's own parameters, buffers and optimizer moments (they differ from
        the other ranks' between syncs), and DiLoCo's outer state (θ at the last sync, the outer momentum,
        SparseLoCo's error feedback: each rank's own)."""
        own = [p.data for p in self._params] + self._buffers_averaged
        state = {"local_sgd.steps": torch.tensor([self.steps], dtype=torch.int64)}
        if own:
            state["local_sgd.model"] = _flatten_dense_tensors(own)
        moments = self._optimizer_state()
        if moments:
            state["local_sgd.optimizer"] = _flatten_dense_tensors(moments)
        if self._anchors:
            state["local_sgd.anchor"] = torch.cat([a.detach() for a in self._anchors])
        if self._outer_optimizer is not None:
            state["local_sgd.outer_momentum"] = torch.cat([m.detach() for m in self._outer_momenta()])
        errors = self._errors()
        if errors:
            state["local_sgd.error_feedback"] = _flatten_dense_tensors(errors)
        return state

    def _errors(self) -> list[torch.Tensor]:
        """SparseLoCo's error feedback, fragment by fragment, tensor by tensor (none without it)."""
        return [e for sparse in self._sparse or [] for e in sparse.error]

    @contextmanager
    def checkpoint_consensus(self, optimizer):
        """The checkpoint's parameters, buffers and optimizer moments are the rank average (one all-reduce,
        outside any step's figures): what another strategy, or another world size, starts from. Each rank's
        own come back after the save, and are in its `checkpoint_rank_state`."""
        tensors = [p.data for p in self._params] + self._buffers_averaged + self._optimizer_state()
        own = [t.clone() for t in tensors]
        with torch.no_grad():
            if tensors:
                flat = _flatten_dense_tensors(tensors)
                all_reduce_mean_(flat, group=self.process_group)
                for tensor, average in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                    tensor.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for tensor, mine in zip(tensors, own):
                    tensor.copy_(mine)

    @torch.no_grad()
    def load_rank_state(self, state: dict[str, torch.Tensor]) -> bool:
        """This rank's own parameters, moments and outer state as saved, where they fit; else afresh from the
        loaded (averaged) model: its steps from 0, θ at the last sync := the loaded parameters, no momentum."""
        own = [p.data for p in self._params] + self._buffers_averaged
        moments = self._optimizer_state()
        errors = self._errors()
        def size(key: str) -> int:
            return state.get(key, torch.empty(0)).numel()

        fits = ("local_sgd.steps" in state and size("local_sgd.model") == sum(t.numel() for t in own)
                and size("local_sgd.optimizer") == sum(t.numel() for t in moments)
                and size("local_sgd.anchor") == sum(a.numel() for a in self._anchors)
                and size("local_sgd.error_feedback") == sum(e.numel() for e in errors))
        if self._outer_optimizer is not None:
            self._outer_optimizer.state.clear()
        if not fits:
            self.steps = 0
            for anchor, frag in zip(self._anchors, self._fragments):
                anchor.copy_(_flatten_dense_tensors([p.detach() for p in frag]))
            for error in errors:
                error.zero_()
            return False
        self.steps = int(state["local_sgd.steps"].item())
        for group, key in ((own, "local_sgd.model"), (moments, "local_sgd.optimizer")):
            if group:
                for tensor, saved in zip(group, _unflatten_dense_tensors(state[key], group)):
                    tensor.copy_(saved)
        if errors:
            for error, saved in zip(errors, _unflatten_dense_tensors(state["local_sgd.error_feedback"], errors)):
                error.copy_(saved)
        sizes = [a.numel() for a in self._anchors]
        for anchor, saved in zip(self._anchors, state["local_sgd.anchor"].split(sizes) if sizes else []):
            anchor.copy_(saved)
        if self._outer_optimizer is not None:
            if "local_sgd.outer_momentum" in state:
                momenta = state["local_sgd.outer_momentum"].split(sizes)
                for anchor, momentum in zip(self._anchors, momenta):  # read on the CPU: onto the anchor's device
                    self._outer_optimizer.state[anchor]["momentum_buffer"] = momentum.to(anchor.device, copy=True)
        return True

    def facts(self) -> dict:
        sync_bytes = sum(tensor_bytes(t) for t in self._params + self._buffers_averaged)
        outer = {"outer_lr": OUTER_LR, "outer_momentum": OUTER_MOMENTUM} if self._outer_optimizer else {}
        fragment_bytes = [sum(tensor_bytes(t) for t in self._fragment_tensors(f)) for f in range(len(self._fragments))]
        sparse = {}
        if self._sparse:  # what comm_bytes counts: the all-gather's output, every rank's payload
            sent = [s.payload_bytes for s in self._sparse]
            sparse = {"outer_bytes_sent_per_sync": sum(sent), "outer_compression": round(sync_bytes / sum(sent), 2)}
            fragment_bytes = [self.dp_size * b for b in sent]
        return {"local_sgd": {"sync_every": self.sync_every, "outer": self.outer, "bytes_per_sync": sync_bytes,
                              "fragments": len(self._fragments), "fragment_bytes": fragment_bytes,
                              "peak_bytes_per_step": max(fragment_bytes), "delay": self.delay, "mix": self.mix,
                              **outer, **sparse}}

    def _fragment_tensors(self, f: int) -> list[torch.Tensor]:
        """Fragment f's parameters (as data), and the buffers with the fragment that syncs at the round's end."""
        buffers = self._buffers_averaged if self._phase[f] == 0 else []
        return [p.data for p in self._fragments[f]] + buffers

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], params=None,
                       **kwargs) -> torch.optim.Optimizer:
        """The plain optimizer, whose every step is followed by `after_step()`."""
        optimizer = super().make_optimizer(optimizer_cls, params, **kwargs)
        self._optimizer = weakref.ref(optimizer)  # whose moments a checkpoint saves for this rank
        this = weakref.ref(self)  # the hook must not keep a discarded wrapper alive

        def hook(optimizer, args, kwargs) -> None:
            wrapper = this()
            if wrapper is not None:
                wrapper.after_step()

        optimizer.register_step_post_hook(hook)
        return optimizer

    def after_step(self) -> None:
        """Count the step; land the delayed syncs due now, then launch the ones that land `delay` steps from now
        (without a delay: do them)."""
        self.steps += 1
        due = [entry for entry in self._pending if entry[0] == self.steps]
        if due:
            self._pending = [entry for entry in self._pending if entry[0] != self.steps]
            with self.comm.exposed(in_optimizer=True):
                for *_, future in due:
                    future.wait()
            for _, f, flat, _ in due:
                self._land(f, flat)
        for f, phase in enumerate(self._phase):
            if self.steps % self.sync_every == (phase - self.delay) % self.sync_every:
                self._sync(f)

    @torch.no_grad()
    def _sync(self, f: int) -> None:
        """Fragment f's rank average: now (then the outer step), or, with a delay, launched to land later."""
        tensors = self._fragment_tensors(f)
        if not tensors:
            return
        if self._sparse:
            return self._sync_sparse(f)
        flat = _flatten_dense_tensors(tensors)
        if self.delay:
            if len(tensors) == 1:  # then the "flat" copy is a view of the tensor itself: it must not change meanwhile
                flat = flat.clone()
            future, stamp = all_reduce_mean_async(flat, group=self.process_group)
            self.comm.carry(stamp)
            self._pending.append((self.steps + self.delay, f, flat, future))
            return
        with self.comm.exposed(in_optimizer=True), self.comm.timed(tensor_bytes(flat)):
            all_reduce_mean_(flat, group=self.process_group)
        self._land(f, flat)

    @torch.no_grad()
    def _sync_sparse(self, f: int) -> None:
        """SparseLoCo: this rank's compressed pseudo-gradient of fragment f, all-gathered (now, or to land later)."""
        anchor, params = self._anchors[f], [p.data for p in self._fragments[f]]
        deltas = [a - p for a, p in zip(_unflatten_dense_tensors(anchor, params), params)]
        with self.comm.arithmetic():
            payload = self._sparse[f].encode(deltas)
        gathered = gathered_buffer(payload, self.dp_size)
        if self.delay:
            future, stamp = launch_stamped(lambda: [all_gather(gathered, payload, group=self.process_group,
                                                               async_op=True)],
                                           tensor_bytes(gathered), gathered.is_cuda)
            self.comm.carry(stamp)
            self._pending.append((self.steps + self.delay, f, gathered, future))
            return
        with self.comm.exposed(in_optimizer=True), self.comm.timed(tensor_bytes(gathered)):
            all_gather(gathered, payload, group=self.process_group)
        self._land(f, gathered)

    @torch.no_grad()
    def _land(self, f: int, mean: torch.Tensor) -> None:
        """Fragment f := the outer step on its average `mean` (plain averaging: the average), mixed with this
        rank's own by `mix`."""
        tensors = self._fragment_tensors(f)
        if self._sparse:  # `mean` is every rank's payload: the anchor takes the averaged sparse step
            with self.comm.arithmetic():
                step = self._sparse[f].decode(mean.view(self.dp_size, -1))
            anchor = self._anchors[f]
            anchor.sub_(_flatten_dense_tensors(step))
            mean = anchor
        elif self._outer_optimizer is not None:
            anchor = self._anchors[f]
            part = mean[:anchor.numel()]  # its parameters; its buffers after them are plainly averaged
            anchor.grad = anchor - part  # the pseudo-gradient Δ = θ - θ̄
            self._outer_optimizer.step()  # the other fragments' anchors have no grad: untouched
            anchor.grad = None  # Δ is used once: not kept until the next sync
            part.copy_(anchor)
        for tensor, synced in zip(tensors, _unflatten_dense_tensors(mean, tensors)):
            if self.mix:
                tensor.mul_(self.mix).add_(synced, alpha=1.0 - self.mix)
            else:
                tensor.copy_(synced)
