"""Synthetic token batches: deterministic per step, each rank taking its slice of the global batch.

Each sequence counts up from a random start with a random stride, within the first ACTIVE_VOCAB
token ids, so the next token is learnable and the loss falls visibly within a few steps from
ln(vocab): a quick sanity check that gradients flow. Speed does not depend on the values. Every rank builds
the same global batch from (seed, step) and keeps rows [rank*b, (rank+1)*b), so the ranks together
see exactly what single-process training on the full batch would.
"""

from __future__ import annotations

import torch

ACTIVE_VOCAB = 128


def global_batch(step: int, batch_size: int, context_length: int, vocab_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    active = min(vocab_size, ACTIVE_VOCAB)
    start = torch.randint(0, active, (batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (batch_size, 1), generator=g)
    return (start + stride * torch.arange(context_length + 1)) % active


def rank_micro_batches(step: int, cfg, rank: int, world_size: int, device: torch.device):
    """This rank's (inputs, targets) micro-batches for one optimizer step."""
    t, m = cfg.train, cfg.model
    tokens = global_batch(step, t.batch_size, m.context_length, m.vocab_size, t.seed)
    local = t.batch_size // world_size
    mine = tokens[rank * local:(rank + 1) * local].to(device, non_blocking=True)
    for chunk in mine.chunk(t.grad_accum_steps):
        yield chunk[:, :-1], chunk[:, 1:]
