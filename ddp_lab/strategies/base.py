"""What every gradient-sync wrapper shares: the broadcast at start, no_sync, comm accounting.

A wrapper is an `nn.Module` around the user's model. Its contract (the trainer relies on nothing
else):

- construction broadcasts every parameter and buffer from rank 0, frozen ones included;
- `forward(*args, **kwargs)` runs the wrapped model (`.module`);
- `finish_gradient_synchronization()` is called after the last `backward()` of a step and before
  `optimizer.step()`, and leaves the rank-averaged gradient in every `.grad`;
- `no_sync()` is a context in which backward must not communicate (gradient accumulation), as in
  torch's DistributedDataParallel;
- `comm` is a `CommStats`: the trainer pops one step's figures from it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ddp_lab.comm_stats import CommStats
from ddp_lab.distributed import broadcast_module_state


def _module_device(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")


class DataParallelBase(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.comm = CommStats(_module_device(module))
        self.require_sync = True
        broadcast_module_state(module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the step after the context synchronizes the sum."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters that receive gradients, each once even when tied, in `parameters()` order."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def finish_gradient_synchronization(self) -> None:
        with self.comm.exposed():
            self._synchronize_gradients()

    def _synchronize_gradients(self) -> None:
        raise NotImplementedError
