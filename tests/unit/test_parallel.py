"""The mesh's arithmetic, a TP plan's checks and schedule, where a split parameter's elements lie, and the
calculator on a mesh answering the course's communication-accounting problem (docs/parallelism.md)."""

from __future__ import annotations

import pytest
import torch

from ddp_lab.analysis.calculator import main as calculator_main
from ddp_lab.analysis.mesh_accounting import mesh_accounting, parse_bandwidth
from ddp_lab.config import compose_model
from ddp_lab.models.facts import meta_model, tp_layers
from ddp_lab.spec.parallel import MeshLayout, mesh_problem, padded_vocab, plan_problem, schedule_totals, tp_schedule
from ddp_lab.spec.strategies import SPECS
from ddp_lab.tensor_parallel.layout import Split, index_map, runs, shard


def test_tp_ranks_are_consecutive_unless_tp_goes_across():
    inside, across = MeshLayout(8, 2), MeshLayout(8, 2, tp_inner=False)
    assert inside.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]] and inside.dp_groups()[0] == [0, 2, 4, 6]
    assert across.tp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]] and across.dp_groups()[0] == [0, 1, 2, 3]
    for layout in (inside, across):
        assert all(layout.rank_at(dp=layout.coordinates(r)[0], tp=layout.coordinates(r)[1], pp=0, cp=0) == r
                   for r in range(8))
    assert inside.label() == "4x2" and MeshLayout(4).describe() == {"dp": 4, "tp": 1, "label": "4x1", "tp_inner": True}


def test_rank_at_names_every_axis():
    """A caller written before an axis existed fails instead of taking its index 0."""
    with pytest.raises(TypeError):
        MeshLayout(8, 2, cp=2).rank_at(0, 0)  # type: ignore[misc]
    with pytest.raises(TypeError):
        MeshLayout(8, 2, cp=2).rank_at(dp=0, tp=0, pp=0)  # type: ignore[call-arg]


def test_expert_groups_are_views_over_the_replicas():
    """ep borrows consecutive dp x cp replicas of one (pp, tp) place; the expert-data-parallel groups hold the same
    place of every expert-parallel group. Every rank is in exactly one group of each."""
    layout = MeshLayout(8, tp=2, ep=2)  # dp 4, tp 2: replicas of tp 0 are 0, 2, 4, 6
    assert layout.ep_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert layout.edp_groups() == [[0, 4], [2, 6], [1, 5], [3, 7]]
    mixed = MeshLayout(8, cp=2, ep=4)  # dp 4 x cp 2: replicas 0..7 are the ranks
    assert mixed.ep_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]] and mixed.edp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [mixed.ep_index(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    staged = MeshLayout(8, pp=2, ep=2)
    for groups in (staged.ep_groups(), staged.edp_groups(), layout.ep_groups(), layout.edp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(8))
    assert staged.ep_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]] and staged.edp == 2
    assert MeshLayout(4, ep=2).label() == "4x1-ep2" and MeshLayout(4, ep=2).describe()["ep"] == 2


@pytest.mark.parametrize(("args", "problem"), [
    ((4, 3, False, 64), "does not divide world_size=4"), ((4, 2, True, 63), "context_length=63 does not divide"),
    ((4, 1, True, 64), "needs parallel.tp > 1"), ((4, 0, False, 64), "must be >= 1"), ((4, 2, True, 64), None)])
def test_the_mesh_is_refused_where_it_cannot_be_laid_out(args, problem):
    found = mesh_problem(*args)
    assert found is None if problem is None else problem in found


def test_a_plan_is_refused_where_tp_does_not_split_whole_heads_or_features():
    plan, shapes, _ = tp_layers(meta_model(compose_model("tiny")))  # 8 heads, d_ff 1024
    assert plan_problem(plan, shapes, 8) is None
    assert "splits 8 heads over parallel.tp=3: model.num_heads must divide" in plan_problem(plan, shapes, 3)
    assert "declares no tensor-parallel plan" in plan_problem({}, {}, 2)
    assert padded_vocab(10000, 3) == 10002 and padded_vocab(64, 4) == 64


def test_the_schedule_is_megatrons_two_all_reduces_per_block_each_way():
    plan, shapes, partial = tp_layers(meta_model(compose_model("tiny")))  # 4 blocks, d_model 256
    plain = tp_schedule(plan, shapes, 2, False, tokens=10, partial_grads=partial)
    forward = [c for c in plain if c.phase == "forward"]
    backward = [c for c in plain if c.phase == "backward"]
    assert len(forward) == 1 + 2 * 4 and len(backward) == 2 * 4 + 1  # + the embedding / the head's input
    assert {c.op for c in forward + backward} == {"all_reduce"} and all(c.nbytes == 10 * 256 * 4 for c in forward)
    sequence = schedule_totals(tp_schedule(plan, shapes, 2, True, tokens=10, partial_grads=partial))
    assert sequence["by_op"]["all_gather"]["bytes"] == sequence["by_op"]["reduce_scatter"]["bytes"]
    assert sequence["by_op"]["all_reduce"]["calls"] == 3 + 2 * 4 + 1  # the loss's 3, each norm's weight gradient
    assert tp_schedule(plan, shapes, 1, False, tokens=10) == []


@pytest.mark.parametrize("split", [Split(0), Split(1), Split(0, chunks=3), Split(0, padded=12)])
def test_each_rank_holds_its_piece_and_the_pieces_make_the_whole_once(split):
    whole = torch.arange(9 * 4, dtype=torch.float32).view(9, 4) if split.chunks == 3 else \
        torch.arange(10 * 6, dtype=torch.float32).view(10, 6)
    tp, seen = 2 if split.chunks == 3 else 3, []
    for rank in range(tp):
        where = index_map(tuple(whole.shape), split, tp, rank)
        piece = shard(whole, split, tp, rank, fill=-1.0).reshape(-1)
        assert torch.equal(piece[where >= 0], whole.reshape(-1)[where[where >= 0]])
        assert (piece[where < 0] == -1).all()
        seen += where[where >= 0].tolist()
        covered = [i for a, b, first in runs(where) for i in range(first, first + b - a)]
        assert covered == where[where >= 0].tolist()  # the runs are the piece's contiguous stretches, in order
    assert sorted(seen) == list(range(whole.numel()))


def test_the_calculator_answers_the_course_problem():
    report = mesh_accounting(compose_model("xxl_ffn"), 64, 4, SPECS["fsdp"](), "fp32", "bf16", 4.6e14,
                             parse_bandwidth("dp=3.6e11,tp=1.8e11"), device_gb=(80.0, 95.0))
    memory, dp, tp = report["memory"], report["dp_axis"], report["tp_axis"]
    assert report["params"]["total"] == 126 * 2 * 16384 * 53248
    assert round(memory["state_whole_model"] / 80e9, 2) == 43.97 and memory["fsdp_devices_to_fit"][95.0] == 38
    assert memory["activations_per_token"] == 126 * (16384 + 53248) * 2
    assert round(dp["tokens_per_device"], 1) == 299.5 and round(dp["book_tokens_per_device"], 1) == 319.4
    assert tp["compute_bound"] and tp["book_compute_bound"] and report["binding"].startswith("dp")
    misread = mesh_accounting(compose_model("xxl_ffn"), 64, 4, SPECS["fsdp"](), "fp32", "bf16", 4.6e14,
                              parse_bandwidth("dp=5.8e10,tp=2.9e10"))
    assert misread["tp_axis"]["compute_bound"] and not misread["tp_axis"]["book_compute_bound"]


def test_the_calculator_command_takes_a_mesh_and_refuses_what_is_not_one(capsys):
    assert calculator_main(["--model", "xxl_ffn", "--world-size", "64", "--tp", "4", "--strategy", "fsdp",
                            "--flops", "4.6e14", "--bandwidth", "dp=3.6e11,tp=1.8e11"]) == 0
    out = capsys.readouterr().out
    assert "binding axis: dp" in out and "299.5 tokens per device" in out
    with pytest.raises(SystemExit):
        calculator_main(["--model", "tiny", "--world-size", "6", "--tp", "4"])
    with pytest.raises(ValueError):
        parse_bandwidth("dp=1e9")
