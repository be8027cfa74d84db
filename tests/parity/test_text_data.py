"""Every strategy trains to the single-process weights on data=text too, and its validation loss is the
single-process model's.

The parity proof of ddp_lab/check/parity.py on the built-in text (bytes of Python's help() topics,
memory-mapped windows of 9 tokens) instead of the synthetic sequences, for every registered strategy
with its default knobs, at 3 ranks (an odd world size: each rank's slice of a batch is its own rows of
the windows). Two lossy strategies run where they are exact: powersgd at a rank no matrix is worth
compressing at (each is sent exactly), local_sgd averaging after every step with SGD (linear in the
gradient); demo with 1 x 1 blocks (every coefficient sent, an exact DCT), against sign-SGD on the mean
gradient (what it reduces to: strategies/demo.py). The held-out loss is measured through the strategy's own
forward after every step (rank/held_out.py: no gradients; fsdp gathers), as `train.eval_every=1` does: training
still ends on the single-process weights (measuring changed nothing), and the last measurement equals the reference
model's loss on the same held-out batches. fsdp and fsdp_torch run once more keeping their parameters
gathered after forward (`reshard_after_forward=False`), where a forward without backward is the case
to get right.
"""

import pytest
import torch

from ddp_lab.check.parity import ATOL, RTOL, STEPS, assert_parity, data_cfg, train_distributed
from ddp_lab.check.ranks import run_ranks
from ddp_lab.data.text import python_docs
from ddp_lab.parallel import Parallelism
from ddp_lab.rank.data import BatchSource
from ddp_lab.rank.held_out import HeldOutLoss
from ddp_lab.rank.precision import FP32
from ddp_lab.rank.step import loss_fn
from ddp_lab.spec.strategies import SPECS
from tests.helpers.extras import runnable_specs
from tests.helpers.sign_sgd import SignSGD

TEXT = {"name": "text", "path": None, "val_path": None, "val_fraction": 0.1}
WORLD_SIZE = 3
EXACT_KNOBS = {"powersgd": {"rank": 10**6, "start_iter": 0}, "local_sgd": {"sync_every": 1},
               "demo": {"topk": 1, "chunk": 1}}
SCENARIOS = {**{name: (name, EXACT_KNOBS.get(name, {})) for name in runnable_specs()},
             **{f"{name}_kept_gathered": (name, {"reshard_after_forward": False}) for name in ("fsdp", "fsdp_torch")}}
SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}  # where the strategy is exact for a linear update only
REFERENCE = {"demo": {"optimizer_cls": SignSGD, "opt_kwargs": {"lr": 1e-2, "weight_decay": 0.01}}}


def _held_out_cfg(world_size):
    cfg = data_cfg(batch_size=2 * world_size, data=TEXT)
    cfg.train.update({"eval_batches": 2, "eval_every": 0, "steps": 1})
    cfg.world_size = world_size  # the mesh Parallelism builds: data parallelism alone
    return cfg


def _every_strategy(rank, world_size):
    out = {}
    for scenario, (name, knobs) in SCENARIOS.items():
        spec = SPECS[name](**knobs)
        cfg = _held_out_cfg(world_size)
        held_out = HeldOutLoss(cfg, BatchSource(cfg, rank, world_size, torch.device("cpu")),
                               Parallelism(cfg, torch.device("cpu")).held_out_loss)
        measured = []
        sgd = REFERENCE.get(name, {"optimizer_cls": torch.optim.SGD, "opt_kwargs": SGD}) if name in EXACT_KNOBS else {}
        out[scenario] = train_distributed(
            rank, world_size, spec.build, "byte_transformer", batch_size=2 * world_size, data=TEXT,
            after_step=lambda wrapper, h=held_out, m=measured: m.append(h.measure(wrapper, FP32)),
            inspect=lambda wrapper, optimizer, m=measured: m, **sgd)
    return out


@pytest.fixture(scope="module")
def results():
    python_docs()  # the corpus, written once here rather than raced for by the ranks
    return run_ranks(_every_strategy, WORLD_SIZE)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_same_weights_as_single_process_on_text(results, name):
    assert_parity([r[name][:2] for r in results])


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_validation_loss_through_the_strategy_is_the_models(results, name):
    from ddp_lab.check.models import MODELS

    model = MODELS["byte_transformer"]()
    model.load_state_dict(results[0][name][1])
    with torch.no_grad():
        held_out = BatchSource(_held_out_cfg(WORLD_SIZE), 0, 1, torch.device("cpu")).held_out_batches()
        losses = [loss_fn(model(x), y) for x, y in held_out]
    expected = float(torch.stack(losses).mean())
    for rank in range(WORLD_SIZE):
        measured = results[rank][name][2]
        assert len(measured) == STEPS and measured[-1] == pytest.approx(expected, rel=RTOL, abs=ATOL)
        assert measured[-1] < measured[0]  # it trained
