"""The loss of every job, and its vocab-parallel form: the logits are never gathered whole.

`CrossEntropy` is the mean next-token cross-entropy every job trains on; the train step calls it and runs
its backward inside `context()` (nothing for it; torch's `loss_parallel`, which its backward needs too, for
DTensor's logits). `VocabParallelCrossEntropy` is Megatron's: each rank holds the logits of its slice of the
vocabulary, and three all-reduces of one float per token (the max logit, the target's logit, the sum of
exponentials) give every rank the exact loss; the backward is local (softmax minus the one-hot, on this
rank's columns). Logits of padded vocabulary rows are set to -inf first: they take no probability.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from ddp_lab.tensor_parallel.comm import TPContext, all_reduce_max, all_reduce_sum


class CrossEntropy:
    """Mean cross-entropy of (batch, sequence, vocab) logits against (batch, sequence) targets."""

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def context(self):
        """What forward, loss and backward run inside (torch's loss_parallel for DTensor logits)."""
        return nullcontext()


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, tp: TPContext, vocab_start: int, real_columns: int):
        logits = logits.clone()
        if real_columns < logits.shape[-1]:
            logits[:, real_columns:] = float("-inf")
        shifted = logits - all_reduce_max(logits.max(dim=-1).values, tp).unsqueeze(-1)
        mine = (targets >= vocab_start) & (targets < vocab_start + real_columns)
        local = (targets - vocab_start).masked_fill(~mine, 0)
        target_logit = all_reduce_sum(shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0), tp)
        exp = shifted.exp_()
        sum_exp = all_reduce_sum(exp.sum(dim=-1), tp)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), mine, local)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, mine, local = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = mine.nonzero().flatten()
        grad_logits[rows, local[rows]] -= 1.0
        return grad_logits * grad.unsqueeze(-1), None, None, None, None


class VocabParallelCrossEntropy(CrossEntropy):
    """The mean cross-entropy of logits split by vocabulary over the TP ranks (this rank's columns are the ids
    [vocab_start, vocab_start + real_columns), then padding)."""

    def __init__(self, tp: TPContext, vocab_start: int, real_columns: int):
        self.tp, self.vocab_start, self.real_columns = tp, vocab_start, real_columns

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        per_token = _VocabParallelCE.apply(logits.flatten(0, 1).float(), targets.flatten(), self.tp,
                                           self.vocab_start, self.real_columns)
        return per_token.mean()


class LossParallel(CrossEntropy):
    """torch's vocab-parallel cross-entropy: DTensor logits split by vocabulary, under `loss_parallel`. The loss, a
    DTensor replicated over the TP ranks, is handed on as its local tensor (the whole value on every rank, its
    backward through DTensor's), so what reads it (the step's loss, the held-out mean) sees a plain tensor."""

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        loss = super().__call__(logits, targets)
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def context(self):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
