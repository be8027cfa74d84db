"""What autograd saves for backward, counted: the activation memory of a step, beside the model state
rank/memory.py counts.

Counted on one step (the first: a warm-up step unless train.warmup_steps=0) through saved-tensor hooks, each
storage once and whole; a parameter (an `nn.Parameter`, frozen ones too, or a view of one: a strategy's gathered
weight, tensor parallelism's shard view) is model state, not an activation (a stage's received input, a leaf that
requires grad, is one). A pipeline stage counts each micro-batch's
forward and frees it at its backward (pipeline_parallel/lab.py): its peak is the schedule's micro-batches in
flight; a plain step's micro-batches run one after the other, so its peak is one micro-batch's.
"""

from __future__ import annotations

import torch
from torch import nn

from ddp_lab.units import tensor_bytes


def _is_parameter(tensor: torch.Tensor) -> bool:
    return isinstance(tensor._base if tensor._base is not None else tensor, nn.Parameter)


class SavedActivations:
    """Bytes autograd saves in each counted forward: the largest one's (`largest`), and the most alive at once
    (`peak`)."""

    def __init__(self):
        self.alive: dict[object, int] = {}
        self.now = self.peak = self.largest = 0

    def counting(self, key):
        """(the hooks to run a forward under, `done()` to call after it); `freed(key)` when its backward ran."""
        saved: dict[int, int] = {}  # storage address -> bytes

        def pack(tensor):
            if tensor.device.type == "meta" or _is_parameter(tensor):
                return tensor
            try:
                storage = tensor.untyped_storage()
                saved[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # no storage of its own to read (a DTensor's, a functional tensor's): its bytes
                saved[id(tensor)] = tensor_bytes(tensor)
            return tensor

        def done():
            self.alive[key] = sum(saved.values())
            self.largest = max(self.largest, self.alive[key])
            self.now += self.alive[key]
            self.peak = max(self.peak, self.now)
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), done

    def freed(self, key) -> None:
        self.now -= self.alive.pop(key, 0)
