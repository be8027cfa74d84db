"""Per-step timing and the cross-rank reduction that makes a step's figures the job's figures (each as its
row in spec/figures.py says).

A step ends when the last rank ends, so each timing is the slowest rank's; the loss is the mean
over ranks (each rank's loss is over its own slice), and so are a step's phases (the timer's laps):
per-phase maxima from different ranks would add up to more than the step, while rank means add up
to the average rank's step. Counters (collectives, bytes) are the same on
every rank and reported from rank 0's view as the max.

Exposed comm is the most-waiting rank's (the max, as every timing), and beside it the least-waiting
rank's (`exposed_comm_min_rank_ms`): the rank that ended backward last waits only for what
communication backward did not hide, every other rank also for it to arrive. Their difference is
the ranks' skew, not communication; the step-time predictor, which replays ranks alike, predicts
the least-waiting rank's figure.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ddp_lab.rank.process_group import synchronize
from ddp_lab.spec.figures import figure, training_figures


class StepTimer:
    """Wall time of one iteration with the device synchronized on both ends, and its phases.

    `lap(name)` records the time since the previous lap (or the start) under `name` in `laps`, so
    the report can split a step into forward+backward, synchronization and optimizer without the
    loop holding any clocks of its own. Each lap synchronizes the device: queued kernels are billed
    to the phase that launched them.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.started = self.stopped = self._mark = 0.0
        self.laps: dict[str, float] = {}
        self.marks: dict[str, float] = {}  # perf_counter seconds at which each lap ended (profile=true reads them)

    def start(self) -> None:
        synchronize(self.device)
        self.started = self._mark = time.perf_counter()
        self.laps, self.marks = {}, {}

    def lap(self, name: str) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        self.laps[name] = (now - self._mark) * 1e3
        self.marks[name] = self._mark = now

    def stop_ms(self) -> float:
        synchronize(self.device)
        self.stopped = time.perf_counter()
        return (self.stopped - self.started) * 1e3


def reduce_over_ranks(local: dict[str, float], device: torch.device) -> dict[str, float]:
    """One all_gather of every rank's numbers (outside the timed region); rank 0 uses the result."""
    keys = sorted(local)
    rows = [figure(key) for key in keys]  # each as its row in spec/figures.py says; a key with none is refused
    mine = torch.tensor([float(local[k]) for k in keys], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    table = torch.stack(gathered).cpu()
    out = {}
    for i, (key, row) in enumerate(zip(keys, rows)):
        value = float(table[:, i].mean() if row.ranks == "mean" else table[:, i].max())
        out[key] = int(value) if isinstance(local[key], int) else value
    for least in training_figures():
        if least.ranks == "min" and least.of in local:
            out[least.key] = float(table[:, keys.index(least.of)].min())
    return out
