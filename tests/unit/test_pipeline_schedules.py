"""The pipeline schedules on paper (spec/pipeline.py): every action once, no rank waiting forever, the published
bubble at equal stage costs, the activations in flight, the stage split, the refusals; and the report's reading
of a pipeline job (analysis/pipeline.py)."""

from __future__ import annotations

import pytest

from ddp_lab.analysis.pipeline import pipeline_record, plot_schedules, replayed_bubble_pct, schedule_sends, verdict
from ddp_lab.spec.pipeline import (
    bubble_formula,
    pipeline_problem,
    schedule_actions,
    schedule_problem,
    simulate,
    split_blocks,
)

VALID = [(s, pp, m, 1) for s in ("gpipe", "1f1b", "zero_bubble") for pp in (2, 3, 4) for m in (1, 2, 3, 4, 8)] + [
    ("interleaved_1f1b", pp, m, v) for pp in (2, 4) for m in (pp, 2 * pp, 4 * pp) for v in (2, 3)]


@pytest.mark.parametrize("schedule, pp, m, v", VALID)
def test_every_rank_runs_each_micro_batchs_forward_and_backward_once_and_never_waits_forever(schedule, pp, m, v):
    for rank in range(pp):
        actions = schedule_actions(schedule, pp, m, rank, v)
        want = {"F", "I", "W"} if schedule == "zero_bubble" else {"F", "B"}
        assert sorted(actions) == sorted({(k, i, c) for k in want for i in range(m) for c in range(v)}), rank
    simulate(schedule, pp, m, v)  # raises on a deadlock


@pytest.mark.parametrize("schedule, pp, m, v", [c for c in VALID if c[0] != "zero_bubble"])
def test_at_equal_stages_the_simulated_bubble_is_the_published_formula(schedule, pp, m, v):
    """(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(vm+p-1) interleaved, with F 1 and B 2 per action."""
    assert simulate(schedule, pp, m, v).bubble() == pytest.approx(bubble_formula(schedule, pp, m, v))


def test_zero_bubble_fills_part_of_1f1bs_bubble_with_weight_gradients():
    """ZB-H1's split backward at 1F1B's memory: 1/7 at pp 2 and 4 micro-batches where 1F1B idles 1/5, and less
    than 1F1B wherever there is a bubble to fill."""
    assert simulate("zero_bubble", 2, 4).bubble() == pytest.approx(1 / 7)
    assert bubble_formula("zero_bubble", 2, 4) is None
    for pp in (2, 3, 4):
        for m in (1, 2, 4, 8):
            assert simulate("zero_bubble", pp, m).bubble() < simulate("1f1b", pp, m).bubble()


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 4), (4, 2), (4, 8)])
def test_activations_in_flight_gpipe_all_1f1b_and_zero_bubble_at_most_pp_minus_rank(pp, m):
    assert simulate("gpipe", pp, m).peak_in_flight == [m] * pp
    for schedule in ("1f1b", "zero_bubble"):
        assert simulate(schedule, pp, m).peak_in_flight == [min(m, pp - r) for r in range(pp)], schedule


def test_unequal_stages_replayed_idle_more_than_the_formula():
    """A last stage twice as heavy (the output head) stretches the steady phase: the others wait on it."""
    equal = [{"F": 1.0, "B": 2.0}] * 2
    heavy = [{"F": 1.0, "B": 2.0}, {"F": 2.0, "B": 4.0}]
    assert simulate("1f1b", 2, 4, stage_costs=equal).bubble() == pytest.approx(0.2)
    assert simulate("1f1b", 2, 4, stage_costs=heavy).bubble() > 0.3


def test_blocks_split_evenly_the_first_stages_taking_the_remainder_or_as_listed():
    assert split_blocks(4, 2) == [range(0, 2), range(2, 4)]
    assert split_blocks(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert split_blocks(4, 2, [1, 3]) == [range(0, 1), range(1, 4)]


@pytest.mark.parametrize("args, problem", [
    ((2, 1, "pipedream", 4), "parallel.pp_schedule must be one of gpipe, 1f1b, interleaved_1f1b, zero_bubble"),
    ((2, 1, "1f1b", 4, "megatron"), "parallel.pp_impl must be one of lab, torch"),
    ((0, 1, "1f1b", 4), "must be >= 1"),
    ((1, 1, "1f1b", 4), "parallel.microbatches=4 splits a pipeline's batch, and parallel.pp=1 is none"),
    ((1, 2, "1f1b", 1), "parallel.stages_per_rank=2 are a pipeline's virtual stages"),
    ((2, 2, "1f1b", 4), "use parallel.pp_schedule=interleaved_1f1b"),
    ((2, 1, "interleaved_1f1b", 4), "needs parallel.stages_per_rank >= 2"),
    ((2, 2, "interleaved_1f1b", 3), "parallel.microbatches=3 does not divide by it"),
    ((2, 1, "1f1b", 1, "torch"), "torch's Schedule1F1B needs parallel.microbatches >= its 2 stages"),
    ((2, 1, "zero_bubble", 5, "torch"), "parallel.microbatches=5 does not divide into its 2 rounds"),
    ((1, 1, "1f1b", 1), None),
    ((2, 1, "1f1b", 1), None),
    ((2, 2, "interleaved_1f1b", 2, "torch"), None),
])
def test_pipeline_keys_that_cannot_go_together_are_refused_in_one_line(args, problem):
    found = schedule_problem(*args)
    assert found is None if problem is None else problem in found


@pytest.mark.parametrize("args, problem", [
    ((4, 1, "1f1b", 2, 8, 2, None, 1), "4 stages, more than the model's 2 blocks"),
    ((2, 1, "1f1b", 3, 8, 4, None, 1), "does not divide"),
    ((2, 1, "1f1b", 2, 8, 4, [1, 2], 1), "must give every stage at least one of the model's 4 blocks"),
    ((2, 1, "1f1b", 2, 8, 4, [4], 1), "lists 1 stages, the pipeline has 2"),
    ((2, 1, "1f1b", 2, 8, 4, None, 2), "a pipeline's micro-batches are its accumulation"),
    ((2, 1, "1f1b", 2, 8, 4, [1, 3], 1), None),
])
def test_a_pipeline_that_does_not_fit_the_model_or_batch_is_refused(args, problem):
    found = pipeline_problem(*args)
    assert found is None if problem is None else problem in found


def _summary(bubbles=(30.0, 20.0)) -> dict:
    """A 1F1B job's results as a rank writes them at pp 2, m 4: stage 1 twice stage 0's compute."""
    one = 2 * 16 * 4 * 4  # rows (8 / 4 micro-batches) x context x d_model x fp32
    stages = []
    for rank, bubble in enumerate(bubbles):
        f, b = (1.0, 2.0) if rank == 0 else (2.0, 4.0)
        timeline, clock = [], 0.0
        for act in schedule_actions("1f1b", 2, 4, rank):
            took = (f if act.kind == "F" else b) / 1e3
            timeline.append((act.kind, act.microbatch, 0, clock, clock, clock + took))
            clock += took
        stages.append({"pp_rank": rank, "bubble_pct": bubble, "busy_ms": 12.0 * (rank + 1), "span_ms": 30.0,
                       "action_ms": {"F0": f, "B0": b}, "wait_ms": 1.5, "timeline": timeline,
                       "p2p_bytes": schedule_sends({"per_stage": [0, 0], "schedule": "1f1b", "microbatches": 4,
                                                    "stages_per_rank": 1}, rank) * one,
                       "activation_peak_bytes": (2 - rank) * 1000, "activation_microbatch_bytes": 1000})
    pipeline = {"schedule": "1f1b", "impl": "lab", "microbatches": 4, "stages_per_rank": 1,
                "bubble_formula_pct": 20.0, "bubble_simulated_pct": 20.0, "bubble_measured_pct": sum(bubbles) / 2,
                "in_flight_peak": [2, 1], "per_stage": stages}
    config = {"world_size": 2, "model": {"context_length": 16, "d_model": 4}, "train": {"batch_size": 8},
              "parallel": {"tp": 1, "pp": 2, "microbatches": 4}}
    return {"config": config, "summary": {"mesh": {"pipeline": pipeline}}}


def test_the_report_splits_the_gap_to_the_formula_into_unequal_stages_and_the_rest(tmp_path):
    res = _summary()
    replayed = replayed_bubble_pct(res["summary"]["mesh"]["pipeline"])
    assert replayed == pytest.approx(100 * simulate("1f1b", 2, 4, stage_costs=[{"F": 1, "B": 2},
                                                                              {"F": 2, "B": 4}]).bubble())
    text = verdict(res)
    assert "measured bubble 25.0%, the formula's 20.0% (+5.0 points)" in text
    assert f"unequal stages account for {replayed - 20:+.1f} points" in text
    assert "the heaviest stage 2.00x the lightest" in text
    assert "stage rank 0 0.00 MiB = 4.00 x one activation (4 by the schedule)" in text
    assert "stage rank 0 0.0 MiB = 2.0 micro-batches' (the schedule's 2)" in text
    record = pipeline_record(res)
    assert record["pipeline"] == "1f1b m=4 lab" and record["bubble_pct"] == 25.0
    assert record["bubble_schedule_pct"] == 20.0 and record["pp_wait_mean_ms"] == 1.5
    assert pipeline_record({"summary": {"mesh": {}}})["bubble_pct"] is None and verdict({}) is None
    assert plot_schedules({"job": res["summary"]["mesh"]["pipeline"]}, tmp_path / "p.png").stat().st_size > 0


def test_the_calculator_prices_a_pipeline_from_the_model_itself(capsys):
    """`python -m ddp_lab.calculator --pp`: the stages hold every parameter once, the last stage (the 10,000-word
    head) computes more than the first, so the bubble at the stages' own FLOPs exceeds the formula's; 1F1B keeps
    p - rank micro-batches' activations, GPipe all m; each rank sends the schedule's count of one activation."""
    from ddp_lab.analysis.calculator import main as calculator_main
    from ddp_lab.analysis.pipeline_accounting import pipeline_accounting
    from ddp_lab.config import compose_model
    from ddp_lab.models.facts import parameter_counts

    cfg = compose_model("tiny")
    one_f = pipeline_accounting(cfg, 2, 2, 4, "1f1b", batch=8, wire="fp32")
    gpipe = pipeline_accounting(cfg, 2, 2, 4, "gpipe", batch=8, wire="fp32")
    assert sum(r["params"] for r in one_f["per_rank"]) == parameter_counts(cfg)["total"]
    assert one_f["per_stage"][1]["flops_per_token"] > 2 * one_f["per_stage"][0]["flops_per_token"]
    assert one_f["bubble_equal_stages"] == pytest.approx(0.2) == one_f["bubble_formula"]
    assert one_f["bubble_at_stage_flops"] > 0.3
    assert [r["in_flight"] for r in one_f["per_rank"]] == [2, 1]
    assert [r["in_flight"] for r in gpipe["per_rank"]] == [4, 4]
    assert one_f["activation_bytes"] == 2 * 64 * 256 * 4
    assert [r["p2p_bytes"] for r in one_f["per_rank"]] == [4 * one_f["activation_bytes"]] * 2
    assert calculator_main(["--model", "tiny", "--world-size", "2", "--pp", "2", "--microbatches", "4"]) == 0
    assert "bubble: formula 20.0%, on paper at equal stages 20.0%" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        calculator_main(["--model", "tiny", "--world-size", "2", "--pp", "2", "--microbatches", "3"])
    assert "does not divide into 1 data-parallel ranks x 3 micro-batches" in capsys.readouterr().err


def test_a_micro_batchs_activation_under_pp_x_cp_is_a_replicas_rows_of_this_ranks_tokens():
    """12 ranks as pp 2 x cp 3 (dp 2): a replica's 4 sequences in 2 micro-batches are 1 row each, of 48 / 3 = 16
    tokens on this rank. Counting cp among the data-parallel ranks (as before) gave 4 // 6 // 2 = 0 rows."""
    from ddp_lab.analysis.pipeline import activation_bytes

    cfg = {"world_size": 12, "model": {"context_length": 48, "d_model": 8}, "train": {"batch_size": 4},
           "parallel": {"tp": 1, "pp": 2, "cp": 3, "microbatches": 2}}
    assert activation_bytes(cfg) == 1 * 16 * 8 * 4
