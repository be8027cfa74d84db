"""`train.compile`: every strategy that accepts it trains compiled to single-process weights (to float32 rounding)
and to its own uncompiled run's at 2 gloo ranks, and every sharding one (ZeRO stage 1 to 3) to single-process
weights at 3, where shards are uneven (the uncompiled run's parity there is the every-strategy suite's; compiling
changes nothing else that depends on the world size); compiled graphs must have run; every one that refuses it
says why before launch.

The backend is aot_eager: Dynamo traces the forward, AOTAutograd the backward, and eager kernels run them, so what
is proven is what compilation does to a strategy (graphs captured, a compiled backward node per unit, the
strategy's hooks outside them), in seconds and without a C++ compiler; inductor's generated kernels (the default
backend, 34 s to compile the tiny model on this machine) run in no test: benchmarks/compile_overlap.sh and the GPU
check run them. The strategies with exact knobs (powersgd, local SGD, DeMo) run them, as the other every-strategy
proofs do.
"""

import pytest
import torch

from ddp_lab.check.parity import assert_parity, train_distributed
from ddp_lab.check.ranks import run_ranks
from ddp_lab.spec.strategies import SPECS
from tests.helpers.compiled import CALLS, counted
from tests.helpers.extras import runnable_specs
from tests.helpers.sign_sgd import SignSGD

COMPILED = [name for name in runnable_specs() if SPECS[name].compile_refusal is None]
SHARDED = [name for name in COMPILED if SPECS[name].zero_stage]
EXACT_KNOBS = {"powersgd": {"rank": 10**6, "start_iter": 0}, "local_sgd": {"sync_every": 1},
               "demo": {"topk": 1, "chunk": 1}}
SGD = {"optimizer_cls": torch.optim.SGD, "opt_kwargs": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}}
REFERENCE = {"demo": {"optimizer_cls": SignSGD, "opt_kwargs": {"lr": 1e-2, "weight_decay": 0.01}}}


def _compiled(spec, module):
    model = spec.build(module)
    model.compile_model(counted)
    return model


def _every_strategy(rank, world_size):
    out = {}
    for name in COMPILED if world_size == 2 else SHARDED:
        spec = SPECS[name](**EXACT_KNOBS.get(name, {}))
        optimizer = REFERENCE.get(name, SGD) if name in EXACT_KNOBS else {}
        batch = {"batch_size": 4 * world_size}  # the global batch divides evenly at 3 ranks too
        before = CALLS[0]
        compiled = train_distributed(rank, world_size, lambda m, s=spec: _compiled(s, m), "transformer", **batch,
                                     **optimizer)
        graphs = CALLS[0] - before  # compiled graphs run in its compiled training
        eager = train_distributed(rank, world_size, spec.build, "transformer", **batch, **optimizer)[0] \
            if world_size == 2 else None
        out[name] = (compiled, eager, graphs)
    return out


@pytest.fixture(scope="module")
def at_two():
    return run_ranks(_every_strategy, 2)


@pytest.fixture(scope="module")
def at_three():
    return run_ranks(_every_strategy, 3)


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_trains_to_single_process_weights_and_to_its_eager_run(at_two, name):
    assert all(r[name][2] > 0 for r in at_two), "no compiled graph ran"
    assert_parity([r[name][0] for r in at_two])
    for compiled, eager, _ in (r[name] for r in at_two):
        for key, value in eager.items():
            torch.testing.assert_close(compiled[0][key], value, atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("name", SHARDED)
def test_compiled_sharding_trains_to_single_process_weights_at_an_odd_world_size(at_three, name):
    assert all(r[name][2] > 0 for r in at_three), "no compiled graph ran"
    assert_parity([r[name][0] for r in at_three])


def test_every_strategy_either_compiles_or_says_why():
    refused = {name: spec.compile_refusal for name, spec in SPECS.items() if spec.compile_refusal is not None}
    assert {"deepspeed_zero1", "local_sgd_torchft"} <= set(refused)
    assert all(len(why) > 20 for why in refused.values())
    assert {"bucketed", "torch_ddp", "zero2", "overlap", "fsdp", "hsdp", "fsdp_torch",
            "replicate_torch"} <= set(COMPILED)
    assert {"zero1", "zero2", "fsdp", "hsdp", "fsdp_torch", "zero1_torch"} <= set(SHARDED)
