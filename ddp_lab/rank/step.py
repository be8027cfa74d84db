"""One optimizer step of plain (non-pipelined) training, and the loss every job trains on.

`train_step` knows only the wrapper contract (strategies/base.py): `no_sync()`,
`finish_gradient_synchronization()`; it never names a strategy nor an axis. The trainer reaches it through
`Parallelism.step` (a pipeline's schedule takes its place there); the parity tests and the benchmarks call it
directly, so every one of them runs the trainer's step.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ddp_lab.rank.precision import FP32, Precision
from ddp_lab.rank.timing import StepTimer
from ddp_lab.spec.figures import FWD_BWD, OPTIMIZER, SYNC
from ddp_lab.tensor_parallel.loss import CrossEntropy

loss_fn = CrossEntropy()
"""The loss every job trains on: the mean next-token cross-entropy (a vocab-parallel one under tensor
parallelism: `Parallelism.loss`)."""


def train_step(model, optimizer, micro_batches: list, timer: StepTimer | None = None, before_step=None,
               set_to_none: bool = True, precision: Precision = FP32, loss: CrossEntropy = loss_fn) -> torch.Tensor:
    """One optimizer step over this rank's micro-batches; returns their mean loss (a 0-d tensor).

    All but the last micro-batch run inside `no_sync()`; `timer.lap` marks the phases;
    `before_step()`, if given, runs between the gradient sync and the optimizer step;
    `set_to_none` is `zero_grad`'s (the trainer's default; the tests also run False);
    `precision`: autocast, loss scaling (rank/precision.py; fp32 changes nothing);
    `loss`: what the model's output takes, forward and backward inside its `context()` (loss.py).
    """
    lap = timer.lap if timer is not None else (lambda phase: None)
    optimizer.zero_grad(set_to_none=set_to_none)
    model.grad_scale = precision.grad_scale  # the gradients below come multiplied by it (fp16's loss scale)
    losses = []
    for i, (inputs, targets) in enumerate(micro_batches):
        with nullcontext() if i == len(micro_batches) - 1 else model.no_sync(), loss.context():
            with precision.autocast():
                logits = model(inputs)
            value = loss(logits.float(), targets) / len(micro_batches)
            precision.backward(value)
        losses.append(value.detach())
    finish_step(model.finish_gradient_synchronization, optimizer, lap, before_step, precision)
    return torch.stack(losses).sum()


def finish_step(synchronize, optimizer, lap, before_step, precision: Precision) -> None:
    """How every step ends once backward is done (this one, and each pipeline schedule's): the gradient sync
    (`synchronize()`), `before_step()`, the optimizer step, each phase lapped."""
    lap(FWD_BWD.key)
    synchronize()
    lap(SYNC.key)
    if before_step is not None:
        before_step()
    precision.step(optimizer)
    lap(OPTIMIZER.key)
