"""What autograd saves for backward, counted: the activation memory of a step, beside the model state
rank/memory.py counts.

Counted on one step (the first: a warm-up step unless train.warmup_steps=0) through saved-tensor hooks, each
storage once and whole; a parameter (an `nn.Parameter`, frozen ones too, or a view of one: a strategy's gathered
weight, tensor parallelism's shard view) is model state, not an activation (a stage's received input, a leaf that
requires grad, is one). A pipeline stage counts each micro-batch's
forward and frees it at its backward (pipeline_parallel/lab.py): its peak is the schedule's micro-batches in
flight; a plain step's micro-batches run one after the other, so its peak is one micro-batch's.

The hooks save a detached alias of each tensor, never the tensor itself, as torch's `saved_tensors_hooks` asks: a
tensor autograd saves as its own node's output (rsqrt's, exp's) holds that node, which would hold it back, a cycle
through C++ that Python's collector cannot see. A backward that frees its graph breaks it; one that keeps the graph
does not (zero bubble's input half runs with `retain_graph=True`, and its weight half never visits the nodes off
the weights' path): every counted micro-batch's graph then stayed alive for the rest of the run, on the stages after
the first (measured on `model=tiny` at context 128, the last of 2 stages: 42 MiB, and 271 MiB with full
checkpointing, whose blocks run under checkpoint's own hooks but whose head and loss ran under these).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch import nn

from ddp_lab.units import tensor_bytes


def _is_parameter(tensor: torch.Tensor) -> bool:
    return isinstance(tensor._base if tensor._base is not None else tensor, nn.Parameter)


def _saved(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(what identifies its storage, the storage's bytes) of a tensor autograd saves, or None where it is model state
    (a parameter, or a view of one) or holds no memory (meta)."""
    if tensor.device.type == "meta" or _is_parameter(tensor):
        return None
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except RuntimeError:  # no storage of its own to read (a DTensor's, a functional tensor's): its bytes
        return id(tensor), tensor_bytes(tensor)


_COUNTING: list[dict] = []
"""The saved-bytes tallies of the forwards being counted now, innermost last (see `kept_outside_hooks`)."""


def kept_outside_hooks(key, nbytes: int) -> None:
    """Count `nbytes` kept for backward where the saved-tensor hooks cannot see them, into the forward being counted
    (none: nothing): selective checkpointing's kept outputs (rank/recompute.py), which torch's selective checkpoint
    caches outside autograd's saved tensors. `key` identifies the storage, counted once."""
    if _COUNTING:
        _COUNTING[-1][key] = nbytes


@contextmanager
def _tallied(saved: dict, pack):
    _COUNTING.append(saved)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
    finally:
        _COUNTING.remove(saved)


class SavedActivations:
    """Bytes autograd saves in each counted forward: the largest one's (`largest`), and the most alive at once
    (`peak`). What activation checkpointing keeps outside autograd's hooks is counted too (`kept_outside_hooks`)."""

    def __init__(self):
        self.alive: dict[object, int] = {}
        self.now = self.peak = self.largest = 0

    def counting(self, key):
        """(the context to run a forward under, `done()` to call after it); `freed(key)` when its backward ran."""
        saved: dict[object, int] = {}  # storage address -> bytes

        def pack(tensor):
            found = _saved(tensor)
            if found is not None:
                saved[found[0]] = found[1]
            return tensor.detach()  # not the tensor itself: see the module docstring

        def done():
            self.alive[key] = sum(saved.values())
            self.largest = max(self.largest, self.alive[key])
            self.now += self.alive[key]
            self.peak = max(self.peak, self.now)
        return _tallied(saved, pack), done

    def freed(self, key) -> None:
        self.now -= self.alive.pop(key, 0)


class HeldActivations:
    """Bytes autograd holds for backward, alive at once, without knowing when a forward ends or its graph is freed
    (a user's pipeline schedule: ddp_lab.check): each saved tensor counted by its storage, once, from when it is
    saved until autograd drops the graph that saved it (a finalizer on what the hook packed); `peak` the most."""

    def __init__(self):
        self.refs: dict[int, list] = {}  # storage -> [bytes, packed holders alive]
        self.now = self.peak = 0

    @contextmanager
    def counting(self):
        def pack(tensor):
            found = _saved(tensor)
            if found is None:
                return tensor.detach()  # model state is not counted, and not packed as itself either
            key, size = found
            holder = _Held(tensor.detach())  # not the tensor itself: see the module docstring
            entry = self.refs.setdefault(key, [size, 0])
            if entry[1] == 0:
                self.now += size
                self.peak = max(self.peak, self.now)
            entry[1] += 1
            weakref.finalize(holder, self._release, key)
            return holder

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.tensor if isinstance(held, _Held)
                                                      else held):
            yield self

    def _release(self, key: int) -> None:
        entry = self.refs[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.refs[key]


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor
