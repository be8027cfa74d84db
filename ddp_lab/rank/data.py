"""This rank's slice of each step's global batch, and of the held-out batches, from the data source.

Every rank builds the same global batch from (seed, step) and keeps rows [rank*b, (rank+1)*b), so
the ranks together see exactly what single-process training on the full batch would; on a token file
a rank reads only its own rows from the memory map (ddp_lab/data/split.py).

data=synthetic: each sequence counts up from a random start with a random stride, within the first
ACTIVE_VOCAB token ids, so the next token is learnable and the loss falls visibly within a few steps
from ln(vocab): a quick sanity check that gradients flow. Its held-out batches are drawn the same way
from steps no training step uses (negative ones).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from omegaconf import OmegaConf

from ddp_lab.data.split import TokenData, open_data

ACTIVE_VOCAB = 128


def global_batch(step: int, batch_size: int, context_length: int, vocab_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    active = min(vocab_size, ACTIVE_VOCAB)
    start = torch.randint(0, active, (batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (batch_size, 1), generator=g)
    return (start + stride * torch.arange(context_length + 1)) % active


def data_name(cfg) -> str:
    """The config's data source; a config without a `data` node (the tests' own) is synthetic."""
    return str(OmegaConf.select(cfg, "data.name", default="synthetic"))


def token_data(cfg) -> TokenData:
    """data=text or data=tokens, opened (memory-mapped) once per process."""
    data = OmegaConf.to_container(cfg.data, enum_to_str=True)
    return _open(tuple(sorted(data.items())), cfg.model.context_length)


@lru_cache(maxsize=4)
def _open(items: tuple, context_length: int) -> TokenData:
    return open_data(OmegaConf.create(dict(items)), context_length)


class BatchSource:
    """The run's data, derived from the config once: this rank's rows of every step's global batch and of
    the fixed held-out batches, and the source's facts. The loop and the held-out loss ask it."""

    def __init__(self, cfg, rank: int, world_size: int, device: torch.device, splits: int | None = None,
                 columns: torch.Tensor | None = None):
        """This rank's rows of `world_size` shares; `splits`: the micro-batches each step's rows are cut into
        (default train.grad_accum_steps; a pipeline's parallel.microbatches); `columns`: the positions of each
        sequence this rank reads (context parallelism's tokens; None: every one)."""
        t, m = cfg.train, cfg.model
        self.batch_size, self.seed, self.accum = t.batch_size, t.seed, splits or t.grad_accum_steps
        self.eval_batches = int(OmegaConf.select(cfg, "train.eval_batches", default=0))  # a test's config: none
        self.context_length, self.vocab_size = m.context_length, m.vocab_size
        local = t.batch_size // world_size
        self.mine, self.device = slice(rank * local, (rank + 1) * local), device
        self.tokens = token_data(cfg) if data_name(cfg) != "synthetic" else None  # None: synthetic
        self.columns = None if columns is None else columns.to(device)  # moved once, not per micro-batch

    def _rows(self, step: int, held_out: bool) -> torch.Tensor:
        if self.tokens is None:
            return global_batch(-1 - step if held_out else step, self.batch_size, self.context_length,
                                self.vocab_size, self.seed)[self.mine]
        split = self.tokens.val if held_out else self.tokens.train
        return torch.from_numpy(split.batch(step, self.seed, self.batch_size, self.mine))

    def micro_batches(self, step: int):
        """This rank's (inputs, targets) micro-batches for one optimizer step."""
        mine = self._rows(step, held_out=False).to(self.device, non_blocking=True)
        for chunk in mine.chunk(self.accum):
            yield self._pair(chunk)

    def _pair(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of token rows: each position's token and the next one, at this rank's columns."""
        inputs, targets = rows[:, :-1], rows[:, 1:]
        if self.columns is None:
            return inputs, targets
        return inputs[:, self.columns], targets[:, self.columns]

    def facts(self) -> dict:
        """The files and the tokens of each split, for W&B and results.json (nothing for data=synthetic)."""
        return {"data": self.tokens.facts()} if self.tokens is not None else {}

    def has_held_out(self) -> bool:
        """Is there a validation split to measure on (synthetic always; a file source unless val_fraction=0)?"""
        return self.eval_batches > 0 and (self.tokens is None or self.tokens.val is not None)

    def held_out_batches(self) -> list:
        """This rank's (inputs, targets) of every held-out batch: the same fixed batches at every evaluation."""
        out = []
        for i in range(self.eval_batches):
            out.append(self._pair(self._rows(i, held_out=True).to(self.device)))
        return out
