"""A pre-launch estimate of one rank's memory, so launch.py refuses what cannot fit.

The model's facts are counted from the model built on the meta device (ddp_lab/models/facts.py): its
parameters, and the activations autograd saves in one forward of a rank's micro-batch. The model state
is arithmetic/zero_bytes.py's (fp32 AdamW, divided over ranks as the strategy's ZeRO stage says), plus one
gradient-sized communication buffer. Errs on the generous side: it only has to tell 'fits' from 'will be
OOM-killed'.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from ddp_lab.arithmetic.zero_bytes import model_state_bytes
from ddp_lab.config import data_parallel_size, micro_batch_size
from ddp_lab.models.facts import activation_bytes, parameter_counts
from ddp_lab.units import fmt_bytes  # noqa: F401  (its home is units.py; the launcher's checks import it here too)

FP32 = 4


def estimate_rank_bytes(cfg: DictConfig, stage: int, shard_ranks: int | None = None, activations: bool = True) -> int:
    """Bytes one rank needs for `cfg`'s model under a strategy of ZeRO stage `stage` (`activations=False`: the
    model state alone, the cheaper half). Both from shapes at a bounded cost (models/facts.py): the model is
    never run, nor built, at the size asked for. Under tensor parallelism a rank holds 1/tp of the parameters
    (a little more: the replicated norms, the vocabulary's padding, left out here) and the strategy shards that
    over the data-parallel ranks (dp x cp: context-parallel ranks hold the same weights); the activations are
    counted whole (more than a rank saves), over cp under context parallelism (each rank holds 1/cp of the
    tokens)."""
    dp = data_parallel_size(cfg)
    cp = int(OmegaConf.select(cfg, "parallel.cp", default=1) or 1)
    n = parameter_counts(cfg.model)["total"] // (cfg.world_size // (dp * cp))
    shards = shard_ranks or dp * cp  # hsdp: its shard group
    model_state = model_state_bytes(n, "fp32", shards, stage)["total"] + FP32 * n  # + a comm buffer
    if not activations:
        return int(model_state)
    return int(model_state) + activation_bytes(cfg.model, micro_batch_size(cfg)) // cp
