"""`train.precision`: the autocast context and fp16's loss scaler, one object the train step asks.

- fp32: nothing happens (no autocast, no scaling): the step is exactly the plain one.
- bf16: the forward runs under `torch.autocast(device, torch.bfloat16)`, so matmuls compute in bf16
  and their backward does too; the weights, the gradients autograd accumulates (the casts'
  backward hands fp32 gradients to the leaves), and the optimizer state stay fp32: fp32 master
  weights, as mixed-precision training keeps them. bf16 has fp32's exponent range: no scaling.
- fp16: the same autocast in float16, plus dynamic loss scaling (`LossScaler`), because fp16's
  small range flushes small gradients to zero: the loss is multiplied by a scale S before
  backward, the gradients divided by S before the update; a step whose gradients hold an inf or
  NaN is skipped and S halved, and S doubles after `growth_interval` clean steps.

The loss itself is computed outside autocast from fp32 logits (cross entropy over a 10000-word
vocabulary in bf16 would round the loss to 3 significant digits).

A strategy whose class takes `compute_dtype` (fsdp casts its gathered parameters itself) gets
the dtype instead of autocast (`autocast=False`); fp16 still scales the loss.

Where the scaler looks: at the gradients the optimizer reads on this rank, which for a sharded
optimizer (zero1, zero2, torch's ZeroRedundancyOptimizer) are only this rank's share, in its inner
`.optim`. Ranks must then agree on skipping a step, or their parameters part: with
`agree_over_ranks` the found-inf flag is all-reduced (MAX) over ranks before deciding, the same
agreement torch's ShardedGradScaler reaches with its all-reduce of found_inf. Strategies whose
ranks all hold the whole averaged gradient need no such collective. The scaler is written by hand
after `torch.amp.GradScaler` (its defaults and update rule; tests/parity/test_precision.py checks
them against it) so that it looks at exactly those gradients.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from ddp_lab.rank.memory import local, local_optimizer

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaler:
    """Dynamic loss scaling, `torch.amp.GradScaler`'s rule and defaults, on the gradients this rank's
    optimizer reads."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, agree_over_ranks: bool = False):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.agree_over_ranks = agree_over_ranks
        self.clean_steps = 0
        self.skipped_steps = 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide this rank's gradients by the scale; True when any is inf or NaN (on any rank, with
        `agree_over_ranks`)."""
        grads = [local(p.grad) for group in local_optimizer(optimizer).param_groups for p in group["params"]
                 if p.grad is not None]  # a DTensor's (fsdp_torch) local shard, unscaled in place
        inv_scale = torch.tensor(1.0 / self.scale, dtype=torch.float32)  # a power of two: exact
        found = torch.zeros(1)
        if grads:
            torch._foreach_mul_(grads, inv_scale.to(grads[0].device))
            found = torch.stack([g.isfinite().all() for g in grads]).logical_not().any().float().reshape(1).cpu()
        if self.agree_over_ranks and dist.is_available() and dist.is_initialized():
            device = grads[0].device if grads and grads[0].is_cuda else torch.device("cpu")
            found = found.to(device)
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item())

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale, step unless a gradient is not finite, update the scale; True when it stepped."""
        found_inf = self.unscale(optimizer)
        if not found_inf:
            optimizer.step()
        self.update(found_inf)
        return not found_inf

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0


class Precision:
    """What `train.precision` changes in a step: `autocast()` around the forward, `backward(loss)`,
    `step(optimizer)`. `Precision("fp32")` changes nothing."""

    def __init__(self, precision: str = "fp32", device_type: str = "cpu", autocast: bool = True,
                 agree_over_ranks: bool = False):
        self.name = str(precision)
        if self.name != "fp32" and self.name not in AUTOCAST_DTYPES:
            raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
        self.dtype = AUTOCAST_DTYPES.get(self.name, torch.float32)
        self.device_type = device_type
        self.uses_autocast = autocast and self.name != "fp32"
        self.scaler = LossScaler(agree_over_ranks=agree_over_ranks) if self.name == "fp16" else None

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype) if self.uses_autocast else nullcontext()

    @property
    def grad_scale(self) -> float:
        """What backward multiplies the gradients by: fp16's current loss scale, else 1."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """What backward starts from: the loss times fp16's loss scale, else the loss."""
        return self.scaler.scaled(loss) if self.scaler is not None else loss

    def backward(self, loss: torch.Tensor) -> None:
        self.scaled(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)

    def record(self) -> dict:
        """Per-step figures for the steps records: fp16's loss scale (after this step's update)."""
        return {"loss_scale": self.scaler.scale} if self.scaler is not None else {}


FP32 = Precision("fp32")
