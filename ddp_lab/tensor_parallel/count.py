"""Counting torch's DTensor collectives, which run where none of the lab's code sees them.

DTensor redistributes through torch's functional collectives (`torch.ops._c10d_functional`), issued from C++
dispatch inside each op: no hook of the lab's is in their path. `FunctionalCollectives` is a dispatch mode
that sees every such op while it is active and tallies its calls and bytes by op, in the lab's convention
(`comm_bytes`: the whole tensor's, an all-gather's output, a reduce-scatter's input). It costs a Python call
per dispatched op, so the trainer runs it on one warm-up step only (a step's collectives are the same every
step: the same shapes, the same plan) and the tests hold its tally to the schedule.
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

_OPS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}
FUNCTIONAL = ("_c10d_functional", "c10d_functional")
"""torch's functional collectives' namespaces: the native ops and the Python ones (loss_parallel issues these)."""


class FunctionalCollectives(TorchDispatchMode):
    """Calls and bytes of the functional collectives dispatched while active, by op (all_reduce, all_gather,
    reduce_scatter)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar the op first: its collectives then come back here (as
            # torch's CommDebugMode does; loss_parallel's all-reduces run inside DTensor's dispatch)
        kwargs = kwargs or {}
        packet = getattr(func, "_overloadpacket", None)
        if packet is not None and getattr(packet, "__module__", "").split(".")[-1] in FUNCTIONAL:
            op = _OPS.get(packet.__name__)
            if op is not None:
                tensor = args[0]
                nbytes = tensor.numel() * tensor.element_size()
                if op == "all_gather":
                    nbytes *= int(args[1])  # group size: the gathered output's bytes
                self.calls[op] += 1
                self.bytes[op] += nbytes
        return func(*args, **kwargs)

    def totals(self) -> dict:
        """{"calls", "bytes", "by_op": {op: {"calls", "bytes"}}}, as spec/parallel.py's `schedule_totals`."""
        by_op = {op: {"calls": self.calls[op], "bytes": self.bytes[op]} for op in self.calls}
        return {"calls": sum(self.calls.values()), "bytes": sum(self.bytes.values()), "by_op": by_op}
