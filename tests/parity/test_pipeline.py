"""Pipeline parallelism, every schedule by hand and torch's, alone and with every data-parallel strategy on its dp
axis, trains to the weights of one process.

Every scenario runs `ddp_lab.check.parity.train_on_mesh` with the `parallel` node's pipeline keys: the model
(different on every rank) cut into stages (ddp_lab/pipeline_parallel/), the schedule run by the step runner the
trainer uses (`Parallelism.step`), the strategy on the dp axis; the stages' weights gathered whole must equal
single-process training on the full batch (4 AdamW steps, global batch 8).

Tolerance: fp32 to rounding (check/parity.py's ATOL 1e-5, RTOL 1e-4). A pipeline does the same arithmetic as one
process on each micro-batch; what it changes is the order the micro-batches' gradients are summed in (one
process sums a batch's rows inside its matmuls), the size data parallelism's reordering shows.

The scenarios of one world size run in one set of ranks (module-scoped fixtures): 2 ranks for pp 2 alone,
4 ranks for pp 4 and pp 2 x dp 2 and pp 2 x tp 2.
"""

from __future__ import annotations

import pytest
import torch

from ddp_lab.check.models import CONTEXT, MODELS
from ddp_lab.check.parity import GLOBAL_BATCH, STEPS, assert_parity, train_on_mesh
from ddp_lab.spec.pipeline import schedule_actions, simulate, stage_index
from tests.helpers.distributed import ranks_fixture

IMPLS = ["lab", "torch"]
SCHEDULES = ["gpipe", "1f1b", "zero_bubble"]


def _pp(pp=2, schedule="1f1b", impl="lab", m=4, v=1, layers=None) -> dict:
    return {"pipeline": dict(pp=pp, pp_schedule=schedule, pp_impl=impl, microbatches=m, stages_per_rank=v,
                             stage_layers=layers)}


def _refused(impl: str, schedule: str, m: int, stages: int) -> bool:
    """torch's Schedule1F1B asks for at least as many micro-batches as stages (the launcher refuses fewer)."""
    return impl == "torch" and schedule == "1f1b" and m < stages


def _pp2_cases() -> dict:
    cases = {}
    for impl in IMPLS:
        for schedule in SCHEDULES:
            for m in (1, 4, 8):
                if not _refused(impl, schedule, m, 2):
                    cases[f"{schedule} m{m} {impl}"] = ("transformer", "none", _pp(2, schedule, impl, m))
        for m in (2, 4):
            cases[f"interleaved v2 m{m} {impl}"] = ("deep_transformer", "none", _pp(2, "interleaved_1f1b", impl, m,
                                                                                   v=2))
    cases["1f1b uneven stages"] = ("deep_transformer", "none", _pp(2, "1f1b", "lab", 4, layers=[1, 3]))
    cases["gpipe uneven stages torch"] = ("deep_transformer", "none", _pp(2, "gpipe", "torch", 4, layers=[3, 1]))
    cases["1f1b stages by flops"] = ("deep_transformer", "none", _pp(2, "1f1b", "lab", 4, layers="auto"))
    cases["zero bubble stages by flops torch"] = ("deep_transformer", "none", _pp(2, "zero_bubble", "torch", 4,
                                                                                  layers="auto"))
    cases["frozen"] = ("frozen_toy", "none", _pp(2, "1f1b", "lab", 4))
    cases["frozen torch"] = ("frozen_toy", "none", _pp(2, "zero_bubble", "torch", 4))
    cases["tied across stages"] = ("tied_toy", "none", _pp(2, "gpipe", "lab", 2))
    cases["tied across stages torch"] = ("tied_toy", "none", _pp(2, "1f1b", "torch", 2))
    cases["tied across stages zero bubble"] = ("tied_toy", "none", _pp(2, "zero_bubble", "lab", 4))
    return cases


def _pp4_cases() -> dict:
    """pp 4 on the 4-block Transformer, and pp 2 with strategies on dp 2 under torch's schedules, with tied and frozen
    weights, or with tensor parallelism on tp 2 (each strategy under each of the lab's schedules:
    test_strategy_mesh.py)."""
    cases = {}
    for impl in IMPLS:
        for schedule in SCHEDULES:
            if not _refused(impl, schedule, 4, 4):
                cases[f"pp4 {schedule} {impl}"] = ("deep_transformer", "none", _pp(4, schedule, impl, 4))
    cases["pp4 1f1b m2 lab"] = ("deep_transformer", "none", _pp(4, "1f1b", "lab", 2))
    for strategy in ("bucketed", "zero2", "torch_ddp", "fsdp_torch"):
        cases[f"dp2 {strategy} torch"] = ("transformer", strategy, _pp(2, "1f1b", "torch", 4))
    cases["dp2 bucketed zero bubble torch"] = ("transformer", "bucketed", _pp(2, "zero_bubble", "torch", 4))
    cases["dp2 fsdp_torch zero bubble torch"] = ("transformer", "fsdp_torch", _pp(2, "zero_bubble", "torch", 4))
    cases["dp2 bucketed interleaved torch"] = ("deep_transformer", "bucketed", _pp(2, "interleaved_1f1b", "torch", 2,
                                                                                   v=2))
    cases["dp2 gpipe zero1 reduce-scatter"] = ("transformer", "zero1", {**_pp(2, "gpipe", "lab", 2),
                                                                       "knobs": {"comm": "reduce_scatter"}})
    for strategy in ("bucketed", "zero2", "zero1", "fsdp_torch", "zero1_torch", "torch_ddp"):
        cases[f"dp2 {strategy} tied across stages"] = ("tied_toy", strategy, _pp(2, "1f1b", "lab", 2))
    cases["dp2 fsdp_torch tied across stages torch"] = ("tied_toy", "fsdp_torch", _pp(2, "1f1b", "torch", 2))
    cases["dp2 zero1 frozen"] = ("frozen_toy", "zero1", _pp(2, "gpipe", "lab", 2))
    cases["dp2 fsdp_torch gpipe gathered once a step"] = ("transformer", "fsdp_torch", {
        **_pp(2, "gpipe", "lab", 4), "inspect": _fsdp_collectives})
    for tp_impl, pp_impl in (("lab", "lab"), ("torch", "lab"), ("lab", "torch")):
        cases[f"tp2 {tp_impl} pp {pp_impl}"] = ("transformer", "none", {**_pp(2, "1f1b", pp_impl, 2), "tp": 2,
                                                                        "impl": tp_impl})
    cases["tp2 sp zero bubble"] = ("transformer", "none", {**_pp(2, "zero_bubble", "lab", 4), "tp": 2,
                                                           "sequence_parallel": True})
    return cases


def _agreeing_cases() -> dict:
    """Strategies that change the arithmetic on purpose: their data-parallel replicas still agree."""
    return {"dp2 powersgd rank 1": ("transformer", "powersgd", {**_pp(2, "1f1b", "lab", 4),
                                                                "knobs": {"rank": 1, "start_iter": 0}})}


def _fsdp_collectives(parallel, ddp, optimizer):
    """(FSDP2's collectives over the run, its units holding parameters on this rank, what it reported holding whole
    beside its shards, the stage's parameter bytes whole: a DTensor's numel is its global one)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in ddp.module.modules() if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_groups]
    whole = sum(p.numel() * p.element_size() for p in ddp.module.parameters())
    return ddp.comm.pop()["collectives"], len(units), ddp.unsharded_bytes, whole


def _run(rank, world_size, cases):
    return {key: train_on_mesh(rank, world_size, model, strategy, **kw) for key, (model, strategy, kw) in cases.items()}


def _untied_sum(rank, world_size):
    """Weights tied across stages whose copies' gradients are never summed: each copy trains on half its gradient."""
    from ddp_lab.pipeline_parallel.stages import TiedAcrossStages

    TiedAcrossStages._sum = lambda self, module: None
    return train_on_mesh(rank, world_size, "tied_toy", **_pp(2, "1f1b", "lab", 2))


def _graph_left() -> int:
    """Autograd nodes and tensors that carry one, alive in this process: what is left of the steps' graphs."""
    import gc

    gc.collect()
    return sum(isinstance(o, torch.autograd.graph.Node) or (isinstance(o, torch.Tensor) and o.grad_fn is not None)
               for o in gc.get_objects())


def _counted(parallel, ddp, optimizer):
    """The lab's activation count (the first step's), the last step's bytes sent, and what is left of the graphs."""
    runner = parallel.pipeline.runner
    return runner.activations.peak, runner.activations.largest, runner.figures["sent_bytes"], _graph_left()


def _memory(rank, world_size):
    return {(schedule, m): train_on_mesh(rank, world_size, "transformer", **_pp(2, schedule, "lab", m),
                                         inspect=_counted)[2]
            for schedule in SCHEDULES for m in (1, 4, 8)}


pp2 = ranks_fixture(_run, 2, _pp2_cases())
pp4 = ranks_fixture(_run, 4, {**_pp4_cases(), **_agreeing_cases()})
memory = ranks_fixture(_memory, 2)


@pytest.mark.parametrize("case", list(_pp2_cases()))
def test_pp2_matches_single_process(pp2, case):
    assert_parity([r[case] for r in pp2])


@pytest.mark.parametrize("case", list(_pp4_cases()))
def test_pp4_and_strategies_under_torchs_schedules_match_single_process(pp4, case):
    assert_parity([r[case] for r in pp4])


@pytest.mark.parametrize("case", list(_agreeing_cases()))
def test_compressing_strategies_keep_their_replicas_agreeing(pp4, case):
    """powersgd's low-rank and DeMo's top-k change the average on purpose: a stage's dp replicas (ranks 0 and 1
    hold stage 0, 2 and 3 stage 1) end with the same weights, bit for bit, and training moved them."""
    for first, other in ((0, 1), (2, 3)):
        mine, theirs = pp4[first][case][0], pp4[other][case][0]
        for name, tensor in mine.items():
            assert torch.equal(tensor, theirs[name]), name
    start = pp4[0][case][1]
    assert any(not torch.equal(pp4[0][case][0][n], start[n]) for n in start)


def test_fsdp2_under_the_labs_pipeline_gathers_each_unit_once_a_step(pp4):
    """As torchtitan runs FSDP under a pipeline: each unit gathered once a step, kept through the 4 micro-batches'
    forwards and backwards, reduce-scattered and resharded after the last (strategies/fsdp_torch.py's
    `before_pipeline_step`): one all-gather and one reduce-scatter a unit a step, where FSDP2's defaults under
    `no_sync()` gathered twice a micro-batch (20 collectives a step on the first stage, 6 now:
    benchmarks/fsdp_under_pipeline.py)."""
    for rank in pp4:
        collectives, units, _, _ = rank["dp2 fsdp_torch gpipe gathered once a step"][2]
        assert units > 0 and collectives == STEPS * 2 * units, (collectives, units)


def test_fsdp2_under_the_labs_pipeline_reports_what_it_holds_whole(pp4):
    """Gathered once a step and reduced once after it, FSDP2 holds the stage's whole parameters and its whole
    gradients (fp32) beside its shards until the reduction: `unsharded_bytes`, which the memory accounting adds to
    the shards' state (rank/memory.py), is twice the stage's parameter bytes (the tiny Transformer's sizes split
    evenly over dp 2: no padding)."""
    for rank in pp4:
        _, _, held, whole = rank["dp2 fsdp_torch gpipe gathered once a step"][2]
        assert whole > 0 and held == 2 * whole, (held, whole)


def test_parity_check_catches_tied_copies_left_unsummed():
    """Guards the guard: without the sum over the two stages, the embedding and the head drift apart."""
    from ddp_lab.check.ranks import run_ranks

    with pytest.raises(AssertionError):
        assert_parity(run_ranks(_untied_sum, 2))


def test_activation_peak_is_the_schedules_micro_batches_in_flight(memory):
    """The activations autograd saved, counted per micro-batch on each stage: at the peak, GPipe holds all m
    micro-batches' and 1F1B (zero bubble too) at most p on the first stage, as the schedule simulated on paper
    says; the bytes per micro-batch do not depend on the schedule."""
    for rank, counted in enumerate(memory):
        for (schedule, m), (peak, per_microbatch, _, _) in counted.items():
            assert per_microbatch > 0 and per_microbatch == counted["gpipe", m][1], (schedule, m, rank)
            assert peak == simulate(schedule, 2, m).peak_in_flight[rank] * per_microbatch, (schedule, m, rank)
        assert counted["gpipe", 8][0] > counted["1f1b", 8][0]


def _one_process_count(rows: int) -> int:
    """What one process's autograd saves for a micro-batch of `rows` sequences: the model's forward and its loss."""
    from ddp_lab.rank.activations import SavedActivations
    from ddp_lab.tensor_parallel.loss import CrossEntropy

    model = MODELS["transformer"]()
    tokens, targets = torch.randint(0, model.lm_head.weight.shape[0], (2, rows, CONTEXT))
    census = SavedActivations()
    hooks, done = census.counting("micro-batch")
    with hooks:
        CrossEntropy()(model(tokens).float(), targets)
    done()
    return census.largest


def test_the_stages_counts_add_up_to_one_process_count(memory):
    """Each micro-batch's saved bytes, the first stage's and the last's together, are what one process saves for it:
    the loss is the last stage's forward too (its log-softmax and targets were left out under a pipeline, 16 KiB
    short at one micro-batch). Beyond one process's count, only what each stage counts of its own: the rotary
    tables (a buffer both stages hold), and the global batch's inputs and targets, whose storage a micro-batch's
    slice is counted by (the census counts a storage whole)."""
    rope = sum(b.untyped_storage().nbytes() for b in MODELS["transformer"]().buffers())
    tokens = GLOBAL_BATCH * CONTEXT * 8  # int64
    for (schedule, m), (_, first, _, _) in memory[0].items():
        last = memory[1][schedule, m][1]
        beyond = first + last - _one_process_count(GLOBAL_BATCH // m)
        assert 0 <= beyond <= rope + 2 * tokens, (schedule, m, first, last, beyond)


def test_no_graph_outlives_its_step(memory):
    """Counting the first step's activations keeps none of its graphs: under zero bubble (whose input half keeps the
    graph for the weights' half) the counted micro-batches' graphs stayed alive for the rest of the run on the last
    stage (rank/activations.py says why)."""
    for rank, counted in enumerate(memory):
        for (schedule, m), (_, _, _, left) in counted.items():
            assert left == 0, (schedule, m, rank, left)


def test_p2p_bytes_are_the_schedules_sends_of_one_activation(memory):
    """A stage sends an activation after each forward (but the last stage's) and an input gradient after each
    backward (but the first stage's), each one micro-batch's residual stream: rows x context x d_model fp32."""
    d_model = MODELS["transformer"]().embed.weight.shape[1]
    for rank, counted in enumerate(memory):
        for (schedule, m), (_, _, sent, _) in counted.items():
            sends = sum((a.kind == "F" and stage_index(rank, a.chunk, 2) < 1) or
                        (a.kind in ("B", "I") and stage_index(rank, a.chunk, 2) > 0)
                        for a in schedule_actions(schedule, 2, m, rank))
            assert sent == sends * (GLOBAL_BATCH // m) * CONTEXT * d_model * 4, (schedule, m, rank)
