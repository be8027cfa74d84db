"""BatchSource: the ranks' slices together are the global batch, split into micro-batches."""

import torch
from omegaconf import OmegaConf

from ddp_lab.rank.data import ACTIVE_VOCAB, BatchSource, global_batch


def _cfg(batch_size=8, grad_accum_steps=1, context_length=16, vocab_size=1000, seed=3):
    return OmegaConf.create({"train": {"batch_size": batch_size, "grad_accum_steps": grad_accum_steps, "seed": seed},
                             "model": {"context_length": context_length, "vocab_size": vocab_size}})


def test_rank_slices_tile_the_global_batch_in_order():
    cfg = _cfg(batch_size=12)
    whole = global_batch(5, 12, 16, 1000, 3)
    pieces = [inputs for rank in range(3)
              for inputs, _ in BatchSource(cfg, rank, 3, torch.device("cpu")).micro_batches(5)]
    assert torch.equal(torch.cat(pieces), whole[:, :-1])


def test_micro_batches_split_a_rank_slice_and_targets_are_the_next_tokens():
    cfg = _cfg(batch_size=8, grad_accum_steps=2)
    micro = list(BatchSource(cfg, 1, 2, torch.device("cpu")).micro_batches(0))
    assert len(micro) == 2 and all(inputs.shape == (2, 16) for inputs, _ in micro)
    mine = global_batch(0, 8, 16, 1000, 3)[4:8]
    assert torch.equal(torch.cat([inputs for inputs, _ in micro]), mine[:, :-1])
    assert torch.equal(torch.cat([targets for _, targets in micro]), mine[:, 1:])


def test_batches_are_deterministic_per_step_and_seed_and_stay_in_the_active_vocabulary():
    a, b = global_batch(7, 4, 16, 1000, 3), global_batch(7, 4, 16, 1000, 3)
    assert torch.equal(a, b)
    assert not torch.equal(a, global_batch(8, 4, 16, 1000, 3))
    assert not torch.equal(a, global_batch(7, 4, 16, 1000, 4))
    assert int(a.max()) < ACTIVE_VOCAB
    assert int(global_batch(0, 64, 16, 50, 0).max()) < 50  # a vocabulary smaller than ACTIVE_VOCAB
