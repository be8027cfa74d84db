"""Tensor parallelism, and every data-parallel strategy on a mesh's dp axis, train to the weights of one process.

Every scenario runs `ddp_lab.check.parity.train_on_mesh`: the mesh a job builds (ddp_lab/parallel/), tensor
parallelism (the lab's Megatron layers or torch's DTensor plan) on a model that starts different on every rank,
the strategy on the dp axis, the trainer's own `train_step` with the mesh's loss; the weights put back whole
(the strategy's full state dict, then over the TP ranks) must equal single-process training on the full batch.

Tolerance: fp32 to rounding (check/parity.py's ATOL 1e-5, RTOL 1e-4). A row-parallel layer sums its ranks'
partial products, and the vocab-parallel loss its ranks' partial sums of exponentials, in another order than
one process's matmul does: measured here at 1.2e-6 at most after 4 AdamW steps on the tiny Transformer, the
size data parallelism alone shows (0.7e-6). bf16: each row-parallel layer rounds its partial products to bf16
before they are summed, one rounding more than one process; held within twice the distance between one
process's bf16 and fp32 runs (measured: TP 6.2e-4, data parallelism alone 5.4e-4, bf16 vs fp32 5.5e-4).

The scenarios of one world size run in one set of ranks (module-scoped fixtures): 2 ranks for tp=2, 4 ranks for
tp=4 and every strategy at dp x tp = 2 x 2.
"""

from __future__ import annotations

import pytest
import torch

from ddp_lab.check.models import CONTEXT, MODELS
from ddp_lab.check.parity import GLOBAL_BATCH, assert_parity, train_on_mesh
from ddp_lab.models.facts import tp_layers
from ddp_lab.spec.parallel import PrepareInput, SequenceNorm, schedule_totals, tp_schedule
from tests.helpers.distributed import ranks_fixture

SGD = {"optimizer_cls": torch.optim.SGD, "opt_kwargs": {"lr": 0.1, "weight_decay": 0.0}}
TP_MODELS = ["toy", "frozen_toy", "tied_toy", "transformer", "odd_vocab_transformer"]
IMPLS = ["lab", "torch"]
EXACT = ["naive", "flat", "overlap", "bucketed", "zero1", "zero2", "fsdp", "torch_ddp", "zero1_torch", "fsdp_torch",
         "replicate_torch"]
"""Every strategy that averages gradients exactly and runs on a mesh (hsdp, DeepSpeed's and torchft's refuse)."""


def _key(*parts) -> str:
    return " ".join(str(p) for p in parts if p not in (None, "", False))


def _tp_cases(tp: int) -> dict:
    cases = {}
    for model in TP_MODELS:
        for impl in IMPLS:
            for sp in (False, True):
                cases[_key(model, impl, sp and "sp")] = (model, "none", dict(tp=tp, impl=impl, sequence_parallel=sp))
    cases["transformer lab accumulation"] = ("transformer", "none", dict(tp=tp, grad_accum_steps=2))
    cases["transformer torch sp accumulation"] = ("transformer", "none", dict(tp=tp, impl="torch",
                                                                           sequence_parallel=True, grad_accum_steps=2))
    return cases


def _tied_gpt():
    """The example model from outside the package (examples/tied_gpt), with its own plan."""
    from examples.tied_gpt.model import TiedGPT

    return TiedGPT(vocab_size=65, context_length=8, d_model=32, num_layers=2, num_heads=4)


def _mesh_cases() -> dict:
    # SGD: its attention's key bias has a gradient that is 0 but for rounding (a score's shift softmax ignores),
    # which AdamW turns into whole steps of either sign, in every run that sums in its own order
    cases = {"tied_gpt from outside": (_tied_gpt, "bucketed", dict(tp=2, **SGD)),
             "tied_gpt from outside torch": (_tied_gpt, "zero2", dict(tp=2, impl="torch", **SGD))}
    for i, strategy in enumerate(EXACT):  # inside the dp axis: test_strategy_mesh.py's, every strategy
        across = IMPLS[i % 2]  # sequence parallelism with TP across the dp axis: each strategy under one impl, in turn
        cases[_key(strategy, across, "sp across")] = ("transformer", strategy, dict(
            tp=2, impl=across, sequence_parallel=True, tp_inner=False))
    cases["zero2 tied"] = ("tied_toy", "zero2", dict(tp=2))
    cases["fsdp frozen torch"] = ("frozen_toy", "fsdp", dict(tp=2, impl="torch"))
    cases["bucketed odd vocab sp"] = ("odd_vocab_transformer", "bucketed", dict(tp=2, sequence_parallel=True))
    return cases


def _agreeing_cases() -> dict:
    """Strategies that change the arithmetic on purpose: their data-parallel replicas still agree."""
    return {"powersgd rank 1": ("transformer", "powersgd", dict(tp=2, knobs={"rank": 1, "start_iter": 0}))}


def _run(rank, world_size, cases):
    return {key: train_on_mesh(rank, world_size, model, strategy, **kw) for key, (model, strategy, kw) in cases.items()}


def _bf16(rank, world_size):
    out = {}
    for precision in ("fp32", "bf16"):
        for impl in IMPLS:
            out[impl, precision] = train_on_mesh(rank, world_size, "transformer", tp=2, impl=impl,
                                                 sequence_parallel=impl == "torch", precision=precision, **SGD)
    return out


def _wrong_row_bias(rank, world_size):
    """A row-parallel layer that adds its bias on every rank before the sum (counted tp times)."""
    import torch.nn.functional as F

    from ddp_lab.tensor_parallel.comm import leave_region
    from ddp_lab.tensor_parallel.layers import RowParallelLinear

    RowParallelLinear.forward = lambda self, x: leave_region(F.linear(x, self.weight, self.bias), self.tp)
    return train_on_mesh(rank, world_size, "toy", tp=world_size)


def _counted(parallel, ddp, optimizer):
    tp = parallel.tensor
    return tp.counted if str(tp.impl) == "torch" else tp.context.totals()


def _held(parallel, ddp, optimizer):
    """(parameters, gradients, optimizer state) elements this rank holds after a step."""
    params = list(ddp.module.parameters())
    state = sum(t.numel() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.ndim)
    return (sum(p.numel() for p in params), sum(p.grad.numel() for p in params if p.grad is not None), state)


def _schedules(rank, world_size):
    out = {}
    for impl in IMPLS:
        for sp in (False, True):
            out["count", impl, sp] = train_on_mesh(rank, world_size, "transformer", tp=2, impl=impl,
                                                   sequence_parallel=sp, steps=1, inspect=_counted)[2]
            out["held", impl, sp] = train_on_mesh(rank, world_size, "odd_vocab_transformer", tp=2, impl=impl,
                                                  sequence_parallel=sp, steps=1, inspect=_held)[2]
    return out


tp2 = ranks_fixture(_run, 2, _tp_cases(2))
tp4 = ranks_fixture(_run, 4, {**{k: v for k, v in _tp_cases(4).items() if "toy" not in k or "tied" in k},
                              **_mesh_cases(), **_agreeing_cases()})
bf16 = ranks_fixture(_bf16, 2)
schedules = ranks_fixture(_schedules, 2)


@pytest.mark.parametrize("case", list(_tp_cases(2)))
def test_tp2_matches_single_process(tp2, case):
    assert_parity([r[case] for r in tp2])


@pytest.mark.parametrize("case", [k for k in _tp_cases(4) if "toy" not in k or "tied" in k])
def test_tp4_matches_single_process(tp4, case):
    assert_parity([r[case] for r in tp4])


@pytest.mark.parametrize("case", list(_mesh_cases()))
def test_strategies_across_the_dp_axis_and_on_tied_frozen_models_match_single_process(tp4, case):
    assert_parity([r[case] for r in tp4])


@pytest.mark.parametrize("case", list(_agreeing_cases()))
def test_compressing_strategies_keep_their_replicas_agreeing(tp4, case):
    """powersgd's low-rank and DeMo's top-k change the average on purpose; on the dp axis their replicas (rank 0's
    TP group and rank 2's) hold the same weights, bit for bit, and training moved them."""
    first, other = tp4[0][case][0], tp4[2][case][0]
    start = tp4[0][case][1]
    for name, tensor in first.items():
        assert torch.equal(tensor, other[name]), name
    assert any(not torch.equal(first[n], start[n]) for n in first)


def test_bf16_within_its_rounding_of_single_process(bf16):
    for impl in IMPLS:
        tp, reference = bf16[0][impl, "bf16"]
        fp32 = bf16[0][impl, "fp32"][1]
        rounding = max((reference[n] - fp32[n]).abs().max().item() for n in reference)
        for name, tensor in reference.items():
            assert (tp[name] - tensor).abs().max().item() <= 2 * rounding, (impl, name)
        assert_parity([r[impl, "fp32"] for r in bf16])


def test_parity_check_catches_a_row_parallel_bias_added_on_every_rank():
    """Guards the guard: the bias added before the sum counts tp times, and the proof says so."""
    from ddp_lab.check.ranks import run_ranks

    with pytest.raises(AssertionError):
        assert_parity(run_ranks(_wrong_row_bias, 2))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no_sp", "sp"])
def test_counted_collectives_are_the_schedule(schedules, impl, sequence_parallel):
    """The TP axis's collectives of one step, counted (the lab's by its own operators, torch's by a dispatch mode
    over DTensor's functional collectives), are spec/parallel.py's schedule, op for op and byte for byte."""
    plan, shapes, partial = tp_layers(MODELS["transformer"]())
    want = schedule_totals(tp_schedule(plan, shapes, 2, sequence_parallel, GLOBAL_BATCH * CONTEXT,
                                       partial_grads=partial))
    for rank in schedules:
        assert rank["count", impl, sequence_parallel] == want


@pytest.mark.parametrize("impl", IMPLS)
def test_each_rank_holds_its_share_of_parameters_gradients_and_state(schedules, impl):
    """Split parameters at 1/tp (the lab's vocabulary padded to a multiple of tp, torch's split unevenly), the
    norms whole; gradients and AdamW's two moments the same elements."""
    model = MODELS["odd_vocab_transformer"]()
    plan = model.tp_plan()
    split = {n for n, style in plan.items() if not isinstance(style, (SequenceNorm, PrepareInput))}
    replicated = sum(p.numel() for n, p in model.named_parameters() if n.rpartition(".")[0] not in split)
    d = model.embed.weight.shape[1]
    vocab_tables = 2 * model.embed.weight.numel()  # the embedding and the head: 65 rows each
    inner = sum(model.get_submodule(n).weight.numel() for n in split) - vocab_tables  # divides by 2
    rows = [33, 33] if impl == "lab" else [33, 32]  # the lab pads 65 rows to 66; torch.chunk splits 33 + 32
    for rank, result in enumerate(schedules):
        params, grads, state = result["held", impl, False]
        assert params == replicated + inner // 2 + 2 * rows[rank] * d
        assert grads == params and state == 2 * params
        assert result["held", impl, True] == result["held", impl, False]
