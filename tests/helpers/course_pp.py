"""Pipeline schedules as a student completes the lecture's homework (its forward over send/recv given, the
backward left to write), in the shape `python -m ddp_lab.check SCHEDULE --pp 2,4` takes (ddp_lab/check/pipeline.py):
two right (GPipe with blocking sends, 1F1B with asynchronous ones) and one wrong version for each cause the check
names (tests/e2e/test_check_pp.py; docs/check_pp.md)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _receive(step, src: int, tag: int = 0) -> torch.Tensor:
    x = torch.empty(step.activation_shape)
    dist.recv(x, src=src, tag=tag)
    return x.requires_grad_(True)


def _sum_tied(step) -> None:
    for weight, group in step.tied:
        dist.all_reduce(weight.grad, group=group)


def _forward(stage, step, i: int, tag: int | None = None):
    """Micro-batch i through this stage: (its input, its output), the output sent on."""
    first, last = step.rank == 0, step.rank == step.stages - 1
    x = step.inputs[i] if first else _receive(step, step.rank - 1, i if tag is None else tag)
    y = stage(x)
    if not last:
        dist.send(y.detach(), dst=step.rank + 1, tag=i)
    return x, y


def _backward(stage, step, i: int, x, y, divide: int | None = None) -> None:
    """Micro-batch i's backward through this stage, its input's gradient sent back."""
    first, last = step.rank == 0, step.rank == step.stages - 1
    if last:
        loss = step.loss_fn(y, step.targets[i])
        (loss / (step.microbatches if divide is None else divide)).backward()
    else:
        grad = torch.empty(step.activation_shape)
        dist.recv(grad, src=step.rank + 1, tag=i)
        y.backward(grad)
    if not first:
        dist.send(x.grad, dst=step.rank - 1, tag=i)


def gpipe(stage, step) -> None:
    """Right: every forward, then every backward, each micro-batch's loss divided by m; tied copies summed (shown
    in docs/check_pp.md, as it is here)."""
    first, last, m = step.rank == 0, step.rank == step.stages - 1, step.microbatches
    flight = []
    for i in range(m):                                   # every forward
        if first:
            x = step.inputs[i]
        else:
            x = torch.empty(step.activation_shape)
            dist.recv(x, src=step.rank - 1, tag=i)
            x.requires_grad_(True)
        y = stage(x)
        if not last:
            dist.send(y.detach(), dst=step.rank + 1, tag=i)
        flight.append((x, y))                            # kept until its backward
    for i, (x, y) in enumerate(flight):                  # then every backward
        if last:
            (step.loss_fn(y, step.targets[i]) / m).backward()   # divided by m once
        else:
            grad = torch.empty(step.activation_shape)
            dist.recv(grad, src=step.rank + 1, tag=i)
            y.backward(grad)
        if not first:
            dist.send(x.grad, dst=step.rank - 1, tag=i)
    for weight, group in step.tied:                      # a tied weight's copies summed
        dist.all_reduce(weight.grad, group=group)


def one_f_one_b(stage, step, capped: bool = True) -> None:
    """Right: 1F1B, at most (stages - rank) micro-batches in flight; sends asynchronous, waited at the end.
    `capped=False`: the warm-up not capped at the micro-batch count (`warmup_not_capped`)."""
    first, last = step.rank == 0, step.rank == step.stages - 1
    m, sends, flight = step.microbatches, [], {}
    warmup = min(m, step.stages - step.rank - 1) if capped else step.stages - step.rank - 1

    def forward(i):
        x = step.inputs[i] if first else _receive(step, step.rank - 1, i)
        y = stage(x)
        if not last:
            sends.append(dist.isend(y.detach(), dst=step.rank + 1, tag=i))
        flight[i] = (x, y)

    def backward(i):
        x, y = flight.pop(i)
        if last:
            (step.loss_fn(y, step.targets[i]) / m).backward()
        else:
            grad = torch.empty(step.activation_shape)
            dist.recv(grad, src=step.rank + 1, tag=i)
            y.backward(grad)
        if not first:
            sends.append(dist.isend(x.grad, dst=step.rank - 1, tag=i))

    for i in range(warmup):
        forward(i)
    for i in range(m - warmup):
        forward(warmup + i)
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    for work in sends:
        work.wait()
    _sum_tied(step)


def warmup_not_capped(stage, step) -> None:
    """1F1B whose warm-up is p - 1 - rank forwards whatever the micro-batch count: with fewer micro-batches than
    that (m < p - 1) the first stage asks for micro-batches that do not exist. Right when m >= p - 1."""
    one_f_one_b(stage, step, capped=False)


def loss_not_divided(stage, step) -> None:
    """GPipe, each micro-batch's loss summed as it is: m times the whole batch's mean."""
    flight = [_forward(stage, step, i) for i in range(step.microbatches)]
    for i, (x, y) in enumerate(flight):
        _backward(stage, step, i, x, y, divide=1)
    _sum_tied(step)


def divided_twice(stage, step) -> None:
    """GPipe with the loss divided by m, and every gradient averaged over the micro-batches again after."""
    gpipe(stage, step)
    for p in stage.parameters():
        if p.grad is not None:
            p.grad /= step.microbatches


def frees_its_outputs(stage, step) -> None:
    """GPipe that keeps each micro-batch's output detached, to free its graph's memory until backward: nothing is
    left for backward to run through."""
    flight = []
    for i in range(step.microbatches):
        x, y = _forward(stage, step, i)
        flight.append((x, y.detach()))
    for i, (x, y) in enumerate(flight):
        _backward(stage, step, i, x, y)
    _sum_tied(step)


def receives_in_reverse(stage, step) -> None:
    """GPipe whose stages after the first receive their micro-batches last first (tags m-1 .. 0), while the stage
    before sends them first first, blocking: each waits for the other."""
    order = list(reversed(range(step.microbatches))) if step.rank > 0 else list(range(step.microbatches))
    flight = {i: _forward(stage, step, i, tag=i) for i in order}
    for i in sorted(flight):
        _backward(stage, step, i, *flight[i])
    _sum_tied(step)


def forgets_the_tie(stage, step) -> None:
    """GPipe, right but for the tied weight: each stage keeps its own copy's gradient."""
    flight = [_forward(stage, step, i) for i in range(step.microbatches)]
    for i, (x, y) in enumerate(flight):
        _backward(stage, step, i, x, y)


def _exchange(ops: list) -> None:
    """Post the point-to-point operations together (`batch_isend_irecv`, as torch's own pipelining stages do) and
    wait for them."""
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def gpipe_batched(stage, step, divided: bool = True) -> None:
    """Right: gpipe over `P2POp`s and `batch_isend_irecv`, peers given as a rank or as a group rank (`group_peer`)."""
    first, last, m = step.rank == 0, step.rank == step.stages - 1, step.microbatches
    flight = []
    for i in range(m):
        if first:
            x = step.inputs[i]
        else:
            x = torch.empty(step.activation_shape)
            _exchange([dist.P2POp(dist.irecv, x, group_peer=step.rank - 1, tag=i)])
            x.requires_grad_(True)
        y = stage(x)
        if not last:
            _exchange([dist.P2POp(dist.isend, y.detach(), step.rank + 1, tag=i)])
        flight.append((x, y))
    for i, (x, y) in enumerate(flight):
        if last:
            loss = step.loss_fn(y, step.targets[i])
            (loss / m if divided else loss).backward()
        else:
            grad = torch.empty(step.activation_shape)
            _exchange([dist.P2POp(dist.irecv, grad, step.rank + 1, tag=i)])
            y.backward(grad)
        if not first:
            _exchange([dist.P2POp(dist.isend, x.grad, group_peer=step.rank - 1, tag=i)])
    for weight, group in step.tied:
        dist.all_reduce(weight.grad, group=group)


def one_f_one_b_batched(stage, step) -> None:
    """Right: 1F1B over `P2POp`s, as Megatron posts them: in the steady phase a stage's send of its forward output
    and its receive of the gradient of an earlier micro-batch go out together in one `batch_isend_irecv`."""
    first, last, m = step.rank == 0, step.rank == step.stages - 1, step.microbatches
    warmup, flight = min(m, step.stages - step.rank - 1), {}

    def forward(i):
        if first:
            x = step.inputs[i]
        else:
            x = torch.empty(step.activation_shape)
            _exchange([dist.P2POp(dist.irecv, x, step.rank - 1, tag=i)])
            x.requires_grad_(True)
        flight[i] = (x, stage(x))
        return flight[i][1]

    def backward(i, grad=None):
        x, y = flight.pop(i)
        if last:
            (step.loss_fn(y, step.targets[i]) / m).backward()
        else:
            if grad is None:
                grad = torch.empty(step.activation_shape)
                _exchange([dist.P2POp(dist.irecv, grad, step.rank + 1, tag=i)])
            y.backward(grad)
        if not first:
            _exchange([dist.P2POp(dist.isend, x.grad, group_peer=step.rank - 1, tag=i)])

    for i in range(warmup):
        y = forward(i)
        if not last:
            _exchange([dist.P2POp(dist.isend, y.detach(), step.rank + 1, tag=i)])
    for i in range(m - warmup):
        y = forward(warmup + i)
        grad = None
        if not last:  # send forward, receive backward: one batch
            grad = torch.empty(step.activation_shape)
            _exchange([dist.P2POp(dist.isend, y.detach(), step.rank + 1, tag=warmup + i),
                       dist.P2POp(dist.irecv, grad, step.rank + 1, tag=i)])
        backward(i, grad)
    for i in range(m - warmup, m):
        backward(i)
    for weight, group in step.tied:
        dist.all_reduce(weight.grad, group=group)


def batched_loss_not_divided(stage, step) -> None:
    """Wrong, as a real schedule over batch_isend_irecv was: each micro-batch's loss never divided by their count."""
    gpipe_batched(stage, step, divided=False)


def gpipe_without_ties(stage, step) -> None:
    """gpipe, which sums no tied weight's copies, and says it supports no tie (its `tied` case is not applicable)."""
    step.tied = []
    gpipe(stage, step)


gpipe_without_ties.supports_ties = False
