"""`python -m ddp_lab.check COLUMN,ROW --tp 2,4`: a pair of tensor-parallel layers proven against one process, and
each wrong version (tests/helpers/course_tp.py, the lecture's homework as students complete it) failed with its
cause, not its victims."""

import pytest

from tests.e2e.test_check import check

HELPERS = "tests.helpers.course_tp"


def lines(out: str) -> dict:
    """(tp, case) -> (verdict, detail)."""
    import re

    found = re.findall(r"^  (ok|FAIL|skip)\s+tp (\d)  (\w+)\s+(.*)$", out, flags=re.M)
    return {(int(tp), case): (verdict, detail) for verdict, tp, case, detail in found}


def test_the_lectures_layers_completed_pass_at_tp_2_and_4(capsys):
    code, out, _ = check(f"{HELPERS}.ColumnParallelLinear,{HELPERS}.RowParallelLinear", "--tp", "2,4", capsys=capsys)
    assert code == 0 and out.strip().endswith("every case passed (12), skipped (2)"), out
    assert {case for _, case in lines(out)} == {"mlp", "attention", "frozen", "uneven", "sequence_parallel",
                                                "inputs_2d", "mesh"}
    # the lecture's layers take no group: every rank is their TP group, so the mesh case cannot tell them theirs
    assert lines(out)[(2, "mesh")][1].startswith("the layers take no group"), out
    assert "3 SGD steps, every TP rank on the same batch" in out.splitlines()[0]


@pytest.mark.parametrize("column, row, cause", [
    ("ColumnWithoutInputAllReduce", "RowParallelLinear",
     "the backward of a column-parallel layer does not all-reduce the input gradient (the output and every piece's "
     "gradient are right"),
    ("ColumnParallelLinear", "RowBiasOnEveryRank",
     "a row-parallel layer adds its bias on every rank (w2: the output is off by {n} x its bias"),
    ("ColumnAlongTheInput", "RowParallelLinear",
     "a shard is taken along the wrong dimension: the column-parallel w1.weight holds columns of the whole weight"),
])
def test_each_wrong_version_fails_with_its_cause(column, row, cause, capsys):
    code, out, _ = check(f"{HELPERS}.{column},{HELPERS}.{row}", "--tp", "2,4", "--cases", "mlp", capsys=capsys)
    found = lines(out)
    assert code == 1, out
    for tp in (2, 4):
        verdict, detail = found[(tp, "mlp")]
        assert verdict == "FAIL" and cause.format(n=tp - 1) in detail.split("FAILED: ")[1], out


def test_a_frozen_layer_that_trains_and_an_uneven_refusal(capsys):
    code, out, _ = check(f"{HELPERS}.ColumnTrainsFrozen,{HELPERS}.RowParallelLinear", "--tp", "2", "--cases",
                         "frozen,mlp", capsys=capsys)
    found = lines(out)
    assert code == 1 and found[(2, "mlp")][0] == "ok", out
    assert "FAILED: a frozen parameter moved (w1.weight)" in found[(2, "frozen")][1], out
    code, out, _ = check(f"{HELPERS}.ColumnRefusesUneven,{HELPERS}.RowParallelLinear", "--tp", "2", "--cases",
                         "uneven", capsys=capsys)
    assert code == 0 and lines(out)[(2, "uneven")] == (
        "skip", "refused when built at tp 2: ValueError: out_features 33 is not divisible by the TP degree 2"), out


def test_sequence_parallelism_where_the_layers_claim_it(capsys):
    """Layers that take `sequence_parallel` run its case (each rank its tokens); a row-parallel bias added to each
    rank's tokens without summing its gradient over the ranks is named; layers that do not take it are skipped."""
    code, out, _ = check(f"{HELPERS}.ColumnParallelLinear,{HELPERS}.RowSequenceBiasNotSummed", "--tp", "2,4",
                         "--cases", "mlp,sequence_parallel", capsys=capsys)
    found = lines(out)
    assert code == 1 and found[(2, "mlp")][0] == found[(4, "mlp")][0] == "ok", out
    for tp in (2, 4):
        assert "FAILED: under sequence parallelism a row-parallel layer's bias gradient is only its own tokens' " \
            "(w2.bias: the ranks' gradients sum to one process's" in found[(tp, "sequence_parallel")][1], out
    code, out, _ = check(f"{HELPERS}.ColumnWithoutInputAllReduce,{HELPERS}.RowParallelLinear", "--tp", "2",
                         "--cases", "sequence_parallel", capsys=capsys)
    assert code == 0 and lines(out)[(2, "sequence_parallel")] == (
        "skip", "the layers take no sequence_parallel argument: none claimed"), out


def test_the_tp_group_goes_to_a_constructor_that_takes_one(capsys):
    code, out, _ = check(f"{HELPERS}.TakesAGroup,{HELPERS}.RowParallelLinear", "--tp", "2", "--cases", "mlp",
                         capsys=capsys)
    assert code == 0, out


SIZED = "tests.helpers.sized_tp"


def test_layers_built_from_sizes_with_a_group_pass_on_a_mesh(capsys):
    """Built as frameworks build them (`(in_features, out_features, bias, group)` and Megatron's `(input_size,
    output_size, bias, tp_group)`), drawing their own weights: the reference is put together from the pieces they
    drew, and on a 2 x 2 mesh each TP group trains as one process (the check before this one called `Column(linear)`
    and could not build them)."""
    code, out, _ = check(f"{SIZED}.SizedColumn,{SIZED}.SizedRow", "--tp", "2", "--cases",
                         "mlp,attention,frozen,inputs_2d,mesh", capsys=capsys)
    assert code == 0 and out.strip().endswith("every case passed (5)"), out


def test_a_layer_reading_the_global_rank_fails_on_the_mesh_naming_it(capsys):
    """Right wherever the TP group is every rank (its mlp case passes, as the whole check did before the mesh
    case); on the 2 x 2 mesh the second group's pieces are not theirs, and the line says why."""
    code, out, _ = check(f"{SIZED}.GlobalRankColumn,{SIZED}.SizedRow", "--tp", "2", "--cases", "mlp,mesh",
                         capsys=capsys)
    found = lines(out)
    assert code == 1 and found[(2, "mlp")][0] == "ok", out
    verdict, detail = found[(2, "mesh")]
    assert verdict == "FAIL" and "FAILED: the layers read the global rank (dist.get_rank()) where their TP group's " \
        "rank belongs (dist.get_rank(group)): the first TP group (ranks 0-1) trains as one process, the group of " \
        "ranks 2-3 does not: the column-parallel w1.weight's pieces ((0, 16), (0, 16)) do not put back" in detail, out


def test_weights_left_unset_by_the_constructor_are_said_once_not_blamed_on_communication(capsys):
    """A false verdict on public code: layers whose constructor leaves torch.empty's memory (drawn by a separate
    reset_parameters()) failed every case with NaN differences and causes about communication. The check makes such
    memory NaN while it builds the layers, says once that the weights are not finite and that reset_parameters()
    exists, and runs nothing more."""
    code, out, _ = check(f"{SIZED}.UnsetColumn,{SIZED}.SizedRow", "--tp", "2,4", capsys=capsys)
    found = lines(out)
    assert code == 1 and [v for v, _ in found.values()].count("FAIL") == 1, out
    verdict, detail = found[(2, "mlp")]
    assert verdict == "FAIL" and detail.split("FAILED: ")[1] == (
        "the layers' weights are not finite after they are built (w1.weight, w1.bias: memory torch.empty left unset, "
        "which the check makes NaN so that it shows on every run): no case can train them; UnsetColumn has "
        "reset_parameters(): call it in the constructor, or draw the weights there"), out
    assert all(v == "skip" and d.startswith("not run: the layers' weights are not finite") for key, (v, d)
               in found.items() if key != (2, "mlp")), out


def test_a_zero_bias_added_on_every_rank_is_named_at_the_first_step(capsys):
    """A false verdict on public code: a row-parallel layer built from sizes, its bias zeros (as Megatron's), that
    adds the bias on every rank passed the forward (zero added tp times is zero) and failed only on a drift after 3
    steps, blamed on the steps. Zero biases now get nonzero values before the reference is put together."""
    code, out, _ = check(f"{SIZED}.SizedColumn,{SIZED}.SizedRowBiasOnEveryRank", "--tp", "2,4", "--cases", "mlp",
                         capsys=capsys)
    found = lines(out)
    assert code == 1, out
    for tp in (2, 4):
        assert found[(tp, "mlp")][1].split("FAILED: ")[1].startswith(
            f"a row-parallel layer adds its bias on every rank (w2: the output is off by {tp - 1} x its bias"), out


def test_uneven_calls_refused_only_the_layers_own_check_and_a_layer_may_take_3d_inputs_only(capsys):
    """A TypeError of the layer's own making on a size that does not divide is a crash, not a refusal (the uneven
    case called any build error refused); a layer that says `takes_2d_inputs = False` skips inputs_2d."""
    code, out, _ = check(f"{SIZED}.UnevenTypeError,{SIZED}.SizedRow", "--tp", "2", "--cases", "uneven",
                         capsys=capsys)
    verdict, detail = lines(out)[(2, "uneven")]
    assert code == 1 and verdict == "FAIL" and "rank 0 raised when its layers were built: TypeError: " in detail \
        and detail.endswith("(no refusal: a layer refuses sizes it cannot split with a ValueError or AssertionError "
                            "of its own)"), out
    code, out, _ = check(f"{SIZED}.ThreeDimensionalColumn,{SIZED}.SizedRow", "--tp", "2", "--cases", "mlp,inputs_2d",
                         capsys=capsys)
    assert code == 0 and lines(out)[(2, "inputs_2d")] == (
        "skip", "the layers say they take inputs of 3 dimensions only (takes_2d_inputs = False)"), out


@pytest.mark.parametrize("argv, message", [
    ([f"{HELPERS}.ColumnParallelLinear,{HELPERS}.RowParallelLinear", "--tp", "1"], "error: --tp takes ranks >= 2"),
    ([f"{HELPERS}.ColumnParallelLinear", "--tp", "2"], "error: 'tests.helpers.course_tp.ColumnParallelLinear': a "
                                                        "tensor-parallel check takes two classes"),
    ([f"{HELPERS}.ColumnParallelLinear,{HELPERS}.Nope"], "error: 'tests.helpers.course_tp' has no class 'Nope'"),
    ([f"{HELPERS}.ColumnParallelLinear,{HELPERS}.RowParallelLinear", "--cases", "plain"], "error: unknown case "
                                                                                          "'plain'; cases: mlp"),
    ([f"{HELPERS}.ColumnParallelLinear,{HELPERS}.RowParallelLinear", "--same-init"], "error: --same-init is a "
                                                                                     "data-parallel check's option"),
    ([f"{HELPERS}.ColumnParallelLinear,{HELPERS}.RowParallelLinear", "--world-size", "4"],
     "error: --world-size is a data-parallel check's option; --tp takes its degrees"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    code, _, err = check(*argv, capsys=capsys)
    assert code == 2 and err.startswith(message) and len(err.strip().splitlines()) == 1, err


def test_the_layers_docs_show_are_the_ones_the_suite_checks():
    """docs/check_tp.md's worked example is tests/helpers/course_tp.py's: f's and g's methods and both forwards, line
    for line."""
    import inspect
    import textwrap
    from pathlib import Path

    from tests.helpers import course_tp
    from tests.helpers.launching import ROOT

    docs = (Path(ROOT) / "docs" / "check_tp.md").read_text()
    block = docs[docs.index("class CopyToRegion(torch.autograd.Function):"):]
    block = block[:block.index("```")]
    methods = [course_tp.CopyToRegion.forward, course_tp.CopyToRegion.backward, course_tp.ReduceFromRegion.forward,
               course_tp.ReduceFromRegion.backward, course_tp.ColumnParallelLinear.forward,
               course_tp.RowParallelLinear.forward]
    for method in methods:
        source = textwrap.indent(textwrap.dedent(inspect.getsource(method)), "    ")
        assert source in block, method.__qualname__
