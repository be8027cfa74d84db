"""train.optimizer=muon: every strategy that keeps parameters whole in its optimizer trains to the weights of
single-process training with the same `MuonAdamW` on the whole batch (frozen, tied, the Transformer; 2 and 3
ranks; bit for bit at 2, where the reference adds the ranks' micro-batches as the all-reduce does). Muon
orthogonalizes each matrix's momentum, so a strategy that handed it the wrong gradient (or a
slice) would land elsewhere. Strategies that are not exact by design (powersgd compresses, local_sgd averages
parameters, demo brings its own optimizer) are left out; the sharded ones refuse muon before launch
(tests/e2e/test_bad_input.py)."""

from __future__ import annotations

import pytest

from ddp_lab.check.parity import assert_parity, train_distributed
from ddp_lab.check.ranks import run_ranks
from ddp_lab.rank.optimizers import MuonAdamW
from ddp_lab.spec.strategies import SPECS
from tests.helpers.distributed import ranks_fixture
from tests.helpers.extras import runnable_specs

NOT_EXACT = ("powersgd", "local_sgd", "demo")
STRATEGIES = [name for name in runnable_specs() if SPECS[name].whole_parameter_optimizer and name not in NOT_EXACT]
MODELS = ("frozen", "tied", "transformer")
MUON = {"lr": 1e-2, "weight_decay": 0.1}


def _run(rank, world_size, strategies, models):
    return {(name, model): train_distributed(rank, world_size, lambda m, n=name: SPECS[n]().build(m), model,
                                             optimizer_cls=MuonAdamW, opt_kwargs=MUON, exact_reference=True,
                                             batch_size=4 * world_size)
            for name in strategies for model in models}


two = ranks_fixture(_run, 2, STRATEGIES, MODELS)


def test_the_whole_parameter_strategies_are_the_ones_expected():
    assert {"naive", "flat", "overlap", "bucketed", "torch_ddp", "zero1", "zero1_torch",
            "replicate_torch"} <= set(STRATEGIES)
    assert not {"zero2", "fsdp", "hsdp", "fsdp_torch"} & set(STRATEGIES)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_muon_matches_single_process(two, strategy, model):
    assert_parity([r[strategy, model] for r in two], exact=True)


def test_muon_at_an_odd_world_size():
    results = run_ranks(_run, 3, ("bucketed", "zero1"), ("tied",))
    for name in ("bucketed", "zero1"):
        assert_parity([r[name, "tied"] for r in results])
