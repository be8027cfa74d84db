"""`python -m ddp_lab.check MOE --ep 2,4`: an expert-parallel mixture-of-experts layer proven against one process, and
each wrong version (tests/helpers/course_moe.py, written as a student writes the course's fourth axis) failed with
its cause."""

import re

import pytest

from ddp_lab.check.experts import _cause
from tests.e2e.test_check import check

MOE = "tests.helpers.course_moe"


def lines(out: str) -> dict:
    """(ep, case) -> (verdict, detail); (ep, "seen CASE") -> ("seen", what was seen)."""
    found = re.findall(r"^  (ok|FAIL|skip|seen)\s+ep (\d)  (\w+)\s+(.*)$", out, flags=re.M)
    return {(int(ep), f"seen {case}" if verdict == "seen" else case): (verdict, detail)
            for verdict, ep, case, detail in found}


def test_a_right_layer_passes_every_case_at_ep_2_and_4_and_its_bytes_are_the_formulas(capsys):
    code, out, _ = check(f"{MOE}.MoE", "--ep", "2,4", capsys=capsys)
    assert code == 0 and out.strip().endswith("every case passed (11), skipped (1)"), out
    assert "float64" in out.splitlines()[0] and "8 experts" in out.splitlines()[0]
    found = lines(out)
    assert found[(4, "mesh")] == ("skip", "the mesh case runs at ep 2 (2 x 2 on 4 ranks)"), out
    for key, (_, seen) in found.items():
        if key[1].startswith("seen"):  # the layer's rows to other ranks are what its counts say, to the byte
            sent, formula = re.match(r"rows to other ranks: ([\d.]+) KiB sent .* = ([\d.]+) KiB;", seen).groups()
            assert sent == formula, seen
    uneven = found[(2, "seen uneven")][1]  # every token picked expert 0, none the last rank's experts (4 to 7)
    assert uneven.endswith(" 0 0 0 0") and uneven.split("over the steps: ")[1].split()[0] == "72", uneven


def test_the_labs_own_layer_with_stacked_experts_passes(capsys):
    """The lab's MoE under the check's contract (tests/helpers/moe.py LabMoE): stacked experts, a frozen selection bias
    that must stay frozen in the frozen case, and the lab's exchange; the student's layer holds a module list."""
    code, out, _ = check("tests.helpers.moe.LabMoE", "--ep", "2", "--cases", "softmax,uneven,frozen,mesh",
                         capsys=capsys)
    assert code == 0 and out.strip().endswith("every case passed (4)"), out


def test_a_kernel_that_refuses_float64_is_checked_in_float32(capsys):
    """torch's parts (torch._grouped_mm) take no float64: in float64 the line says to run --dtype float32, which
    passes, and a wrong version is still named in float32."""
    code, out, _ = check("tests.helpers.moe.TorchPartsMoE", "--ep", "2", "--cases", "softmax", capsys=capsys)
    assert code == 1 and lines(out)[(2, "softmax")][1].endswith(
        "a kernel that refuses float64: run the check with --dtype float32"), out
    code, out, _ = check("tests.helpers.moe.TorchPartsMoE", "--ep", "2", "--dtype", "float32", "--cases",
                         "softmax,uneven,mesh", capsys=capsys)
    assert code == 0 and "(float32, atol 1e-05, rtol 0.0001;" in out.splitlines()[0], out
    code, out, _ = check(f"{MOE}.ExpertGradientsTimesEp", "--ep", "2", "--dtype", "float32", "--cases", "softmax",
                         capsys=capsys)
    assert code == 1 and "every expert's gradient is 2 times one process's" in lines(out)[(2, "softmax")][1], out


@pytest.mark.parametrize("layer, cases, cause", [
    ("NoAutogradExchange", "softmax", "no expert trains: the gradient of experts.0.down.weight"),
    ("DetachedGates", "softmax", "the router gets no gradient through the output, on one process too"),
    ("ScoresNeverApplied", "softmax", "the router gets no gradient through the output, on one process too"),
    ("PerRankBalance", "softmax", "the balancing loss differs from one process's over every rank's tokens"),
    ("CountsNotExchanged", "softmax", "exchange the counts first"),
    ("WrongInverse", "softmax", "the output differs from one process (rank "),
    ("ExpertGradientsTimesEp", "softmax", "every expert's gradient is 2 times one process's while the output is "
                                          "right (ep = 2"),
    ("IndexedPlusEquals", "softmax,top1", "top-1 routing's output is right at this degree, so a token's second "
                                          "expert is what goes wrong"),
])
def test_each_wrong_version_fails_with_its_cause(layer, cases, cause, capsys):
    code, out, _ = check(f"{MOE}.{layer}", "--ep", "2", "--cases", cases, capsys=capsys)
    verdict, detail = lines(out)[(2, "softmax")]
    assert code == 1 and verdict == "FAIL" and cause in detail.split("FAILED: ", 1)[1], out


def test_a_rank_skipping_an_exchange_is_told_by_what_each_rank_waits_in(capsys):
    """The last rank's experts get no rows in the uneven case; a layer that returns early there leaves the others
    in the exchange it skipped: a hang, told rank by rank."""
    code, out, _ = check(f"{MOE}.SkipsAnEmptyExchange", "--ep", "2", "--cases", "uneven", "--timeout", "8",
                         capsys=capsys)
    verdict, detail = lines(out)[(2, "uneven")]
    assert code == 1 and verdict == "FAIL", out
    assert "FAILED: still running after 8 s: " in detail and "rank 0 waits in all_to_all_single" in detail, out


def test_rows_a_receive_buffer_never_got_are_named_from_their_nan():
    """The check fills unset memory with NaN while the layer runs: a rank whose output holds NaN received fewer rows
    than its buffer held (gloo leaves the rest as it was)."""
    found = {"rank": 1, "nan_output": True, "frozen_moved": [], "output": float("inf")}
    assert _cause([{**found, "rank": 0, "nan_output": False}, found], 2).startswith(
        "rank 1's output holds rows its receive buffer never got (NaN")


@pytest.mark.parametrize("argv, message", [
    ([f"{MOE}.MoE", "--ep", "3"], "error: --ep 3: the check's layer has 8 experts; take a degree that divides it"),
    ([f"{MOE}.MoE", "--ep", "2", "--tp", "2"], "error: --tp checks a pair of layers, --pp a schedule, --cp an "
                                               "attention, --ep a mixture of experts: one at a time"),
    (["torch.nn.Linear", "--ep", "2"], "error: torch.nn.modules.linear.Linear takes no width keyword"),
    ([f"{MOE}.MoE", "--ep", "2", "--cases", "plain"], "error: unknown case 'plain'; cases: softmax"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    code, _, err = check(*argv, capsys=capsys)
    assert code == 2 and err.startswith(message) and len(err.strip().splitlines()) == 1, err
