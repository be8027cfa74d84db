"""torchtitan's recipe from torch's own parts (`parallel.ep_impl=torch`): the counts exchanged first, the rows sent
with `torch.distributed._functional_collectives.all_to_all_single_autograd` (torch's differentiable all-to-all), the
experts run as one grouped matmul per weight (`torch._grouped_mm`, offsets by expert).

torch has no expert-parallel module, only these parts. `torch._grouped_mm` refuses float64, wants every row's bytes a
multiple of 16 (d_model and expert_d_ff multiples of 4 in fp32) and fails its backward on a stride-0 gradient; so this
implementation is proven at fp32's tolerance, and the lab's (exchange.py) in float64.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd

from ddp_lab.expert_parallel.exchange import LabExchange, row_bytes
from ddp_lab.models.recomputing import recomputing


def grouped_experts(x: torch.Tensor, counts: list[int], experts) -> torch.Tensor:
    """The SwiGLU experts over rows grouped by expert, three grouped matmuls (offsets: each expert's last row)."""
    offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    w1, w2, w3 = (w.to(x.dtype) for w in (experts.w1, experts.w2, experts.w3))
    hidden = F.silu(torch._grouped_mm(x, w1, offs=offsets)) * torch._grouped_mm(x, w3, offs=offsets)
    return torch._grouped_mm(hidden, w2, offs=offsets)


class TorchExchange(LabExchange):
    """exchange.py's `LabExchange` (counts, permutation, inverse), with torch's differentiable all-to-all and grouped
    matmuls in place of the lab's."""

    def _send(self, x: torch.Tensor, send: list[int], receive: list[int], what: str) -> torch.Tensor:
        start = time.perf_counter()
        out = all_to_all_single_autograd(x.contiguous(), receive, send, self.group)
        out = out.wait() if hasattr(out, "wait") else out
        self.tally.seconds += time.perf_counter() - start
        me = torch.distributed.get_rank(self.group)
        self.tally.add(f"{what}_forward", (sum(send) - send[me]) * row_bytes(x))
        # its backward (torch's own) sends them back, once: not counted again by a checkpointed block's recompute
        if torch.is_grad_enabled() and x.requires_grad and not recomputing():
            self.tally.add(f"{what}_backward", (sum(receive) - receive[me]) * row_bytes(x))
            self._time_backward(x, out)
        return out

    def _time_backward(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """The time of torch's backward all-to-all, which runs inside autograd: from the moment `out`'s gradient is
        ready (its node about to run) to the moment `x`'s is (the exchange the only node between them)."""
        began = []

        def start(grad):
            began.append(time.perf_counter())

        def stop(grad):
            self.tally.seconds += time.perf_counter() - began.pop()
        out.register_hook(start)
        x.register_hook(stop)

    def _run(self, x: torch.Tensor, counts: list[int], experts) -> torch.Tensor:
        return grouped_experts(x, counts, experts)
