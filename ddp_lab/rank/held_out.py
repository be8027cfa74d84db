"""The validation loss: the model's mean cross-entropy on the held-out batches, measured between steps.

Every rank runs the wrapped model's forward (a sharded strategy gathers its parameters as in training)
on its slice of the same fixed held-out batches (rank/data.py), without gradients, and the ranks'
means are averaged (equal slices: the mean of the means is the mean over the whole batch). Its time is
no step's: it runs after the step's timer stopped and its figures were taken, and whatever the
strategy counted while it ran (fsdp's gathers) is dropped. It is not measured on a step the profiler
records, so traces hold training only.

local_sgd between syncs: each rank's replica is measured on its slice, and the figure is their mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_lab.rank.data import BatchSource


class HeldOutLoss:
    def __init__(self, cfg, data: BatchSource, batch_loss, also_drop=None):
        """`batch_loss(model, inputs, targets, precision)`: one batch's mean loss, forward only, on every rank
        (`Parallelism.held_out_loss`: the mesh's loss, through a pipeline's stages); `also_drop()`: figures beyond
        the strategy's that the held-out forward counts (the TP axis's)."""
        self.every, self.last = cfg.train.eval_every, cfg.train.steps - 1
        self.batches = data.held_out_batches() if data.has_held_out() else []
        self.batch_loss, self.also_drop = batch_loss, also_drop

    def due(self, step: int) -> bool:
        """After the last step, and every `train.eval_every` steps."""
        return bool(self.batches) and (step == self.last or (self.every > 0 and (step + 1) % self.every == 0))

    @torch.no_grad()
    def measure(self, model, precision) -> float:
        losses = []
        for inputs, targets in self.batches:
            losses.append(self.batch_loss(model, inputs, targets, precision))
        mean = torch.stack(losses).mean()
        dist.all_reduce(mean)
        model.comm.pop()  # the forward's gathers (fsdp) and the all-reduce above are no step's
        if self.also_drop is not None:
            self.also_drop()
        return float(mean) / dist.get_world_size()
