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


def _rows(step: int, cfg, rank: int, world_size: int, held_out: bool) -> torch.Tensor:
    t, m = cfg.train, cfg.model
    local = t.batch_size // world_size
    mine = slice(rank * local, (rank + 1) * local)
    if data_name(cfg) == "synthetic":
        return global_batch(-1 - step if held_out else step, t.batch_size, m.context_length, m.vocab_size,
                            t.seed)[mine]
    data = token_data(cfg)
    return torch.from_numpy((data.val if held_out else data.train).batch(step, t.seed, t.batch_size, mine))


def rank_micro_batches(step: int, cfg, rank: int, world_size: int, device: torch.device):
    """This rank's (inputs, targets) micro-batches for one optimizer step."""
    mine = _rows(step, cfg, rank, world_size, held_out=False).to(device, non_blocking=True)
    for chunk in mine.chunk(cfg.train.grad_accum_steps):
        yield chunk[:, :-1], chunk[:, 1:]


def token_data_facts(cfg) -> dict:
    """The files and the tokens of each split, for W&B and results.json (nothing for data=synthetic)."""
    return {"data": token_data(cfg).facts()} if data_name(cfg) != "synthetic" else {}


def has_held_out(cfg) -> bool:
    """Is there a validation split to measure on (synthetic always; a file source unless val_fraction=0)?"""
    return cfg.train.eval_batches > 0 and (data_name(cfg) == "synthetic" or token_data(cfg).val is not None)


def rank_held_out_batches(cfg, rank: int, world_size: int, device: torch.device) -> list:
    """This rank's (inputs, targets) of every held-out batch: the same fixed batches at every evaluation."""
    out = []
    for i in range(cfg.train.eval_batches):
        mine = _rows(i, cfg, rank, world_size, held_out=True).to(device)
        out.append((mine[:, :-1], mine[:, 1:]))
    return out
