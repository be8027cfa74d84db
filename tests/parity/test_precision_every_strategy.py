"""train.precision bf16 and fp16 for every registered strategy, in one set of 2 rank processes: each
strategy is built from its spec with its default knobs as a job builds it (tasks/train.py's `wrap`:
autocast and fp16's loss scaling, or the compute dtype where the strategy casts itself), trains 6
steps, and its loss falls on every rank. Through launch.py, tests/e2e/test_precision_launch.py
runs the same wiring for a plain and a sharded sync; the bit-for-bit parity of mixed precision is
tests/parity/test_precision.py's."""

from __future__ import annotations

import pytest
import torch

from ddp_lab.check.models import MODELS
from ddp_lab.check.parity import data_cfg
from ddp_lab.rank.step import train_step
from ddp_lab.spec.strategies import SPECS
from ddp_lab.tasks.train import wrap
from tests.helpers.distributed import ranks_fixture
from tests.helpers.extras import runnable_specs

# DeepSpeed's stages run fp32 only (refused before launch otherwise: tests/parity/test_deepspeed.py)
STRATEGIES = [name for name in runnable_specs() if not name.startswith("deepspeed_")]
PRECISIONS = ["bf16", "fp16"]
STEPS = 6


def _refused(name: str, precision: str) -> bool:
    """The pairs the launcher refuses before any rank starts (demo takes no fp16: its spec's check_run)."""
    try:
        SPECS[name]().check_run(precision, 1)
    except ValueError:
        return True
    return False


PAIRS = [(name, precision) for name in STRATEGIES for precision in PRECISIONS if not _refused(name, precision)]


def _losses(rank, world_size):
    """{(strategy, precision): this rank's loss at each step}."""
    from ddp_lab.rank.data import BatchSource

    batches, out = BatchSource(data_cfg(), rank, world_size, torch.device("cpu")), {}
    for name, precision in PAIRS:
        torch.manual_seed(rank)  # different init per rank: the strategy's start-up broadcast fixes it
        model, optimizer, mixed = wrap(SPECS[name](), MODELS["transformer"](), precision, "cpu",
                                       lr=1e-2, weight_decay=0.0)
        out[name, precision] = [
            train_step(model, optimizer, list(batches.micro_batches(step)), precision=mixed).item()
            for step in range(STEPS)]
    return out


losses = ranks_fixture(_losses, 2)


@pytest.mark.parametrize(("strategy", "precision"), PAIRS, ids=[f"{n}-{p}" for n, p in PAIRS])
def test_every_strategy_trains_in_bf16_and_fp16(losses, strategy, precision):
    per_rank = [rank[strategy, precision] for rank in losses]
    for steps in per_rank:
        assert all(torch.isfinite(torch.tensor(steps))), steps
        assert steps[-1] < steps[0], (strategy, precision, steps)
