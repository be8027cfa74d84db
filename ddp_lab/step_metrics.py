"""Per-step timing and the cross-rank reduction that makes a step's figures the job's figures.

A step ends when the last rank ends, so each timing is the slowest rank's; the loss is the mean
over ranks (each rank's loss is over its own slice). Counters (collectives, bytes) are the same on
every rank and reported from rank 0's view as the max.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ddp_lab.distributed import synchronize

MEAN_KEYS = ("loss",)


class StepTimer:
    """Wall time of one iteration with the device synchronized on both ends."""

    def __init__(self, device: torch.device):
        self.device = device
        self._start = 0.0

    def start(self) -> None:
        synchronize(self.device)
        self._start = time.perf_counter()

    def stop_ms(self) -> float:
        synchronize(self.device)
        return (time.perf_counter() - self._start) * 1e3


def reduce_over_ranks(local: dict[str, float], device: torch.device) -> dict[str, float]:
    """One all_gather of every rank's numbers (outside the timed region); rank 0 uses the result."""
    keys = sorted(local)
    mine = torch.tensor([float(local[k]) for k in keys], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    table = torch.stack(gathered).cpu()
    out = {}
    for i, key in enumerate(keys):
        column = table[:, i]
        value = float(column.mean() if key in MEAN_KEYS else column.max())
        out[key] = int(value) if isinstance(local[key], int) else value
    return out
