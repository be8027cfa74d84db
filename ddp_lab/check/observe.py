"""What a wrapper did, seen from outside, for the line under a case's verdict: parity cannot see sharding,
bucketing or overlap, so the check watches for them while the ranks train.

- collectives: every call of torch.distributed's collectives (and point-to-point messages, which rings are
  built of), made through the module (`dist.all_reduce(...)`), during the training steps (the start-up
  broadcast and the final gather are not counted), per op, and how many were issued while autograd was
  running backward (`torch._C._current_autograd_node()` is set inside a gradient hook): those can overlap
  the rest of backward, the others wait for it;
- held: after the last step, the parameters and the optimizer state rank 0 holds (rank/memory.py's
  accounting: local shards, a sharded optimizer's inner state), against the whole model's and a whole
  AdamW's (two moments per trainable parameter).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ddp_lab.rank.memory import model_state_bytes

COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor",
               "broadcast", "reduce", "all_to_all", "all_to_all_single",
               "send", "recv", "isend", "irecv", "batch_isend_irecv")  # the last: rings built of messages


class Observer:
    """Counts the collectives called through `torch.distributed` while `watching()`; `held()` reads what a
    rank holds. One per case and rank."""

    def __init__(self):
        self.calls, self.in_backward = Counter(), 0

    @contextmanager
    def watching(self):
        originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

        def counted(name, fn):
            def call(*args, **kwargs):
                self.calls[name] += 1
                self.in_backward += torch._C._current_autograd_node() is not None
                return fn(*args, **kwargs)
            return call

        for name, fn in originals.items():
            setattr(dist, name, counted(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    @staticmethod
    def held(wrapper, optimizer, full_param_bytes: int, trainable_bytes: int) -> dict:
        """{"params_pct", "optimizer_pct"}: what this rank holds of the whole model's parameters and of a
        whole AdamW's state (None for an optimizer that keeps none, plain SGD)."""
        held = model_state_bytes(wrapper, optimizer)
        full_state = 2 * trainable_bytes
        return {"params_pct": 100 * held["params"] / full_param_bytes,
                "optimizer_pct": 100 * held["optimizer_state"] / full_state if held["optimizer_state"] else None}


def describe(seen: dict, steps: int) -> str:
    """One line: collectives per step by op, how many during backward, and what rank 0 holds."""
    calls = Counter(seen["calls"])
    total = sum(calls.values())
    ops = ", ".join(f"{op} {n / steps:g}" for op, n in calls.most_common())
    when = (f"{seen['in_backward'] / steps:g} of them issued during backward (can overlap it)" if seen["in_backward"]
            else "none during backward (each waits for backward to end)")
    plural = "" if total == steps else "s"
    collectives = f"per step {total / steps:g} collective{plural} ({ops}), {when}" if total else "no collective seen"
    state = seen["held"]
    optimizer = f", {state['optimizer_pct']:.0f}% of AdamW's state" if state["optimizer_pct"] is not None else ""
    return f"{collectives}; rank 0 holds {state['params_pct']:.0f}% of the parameters{optimizer}"
