"""`python -m ddp_lab.check ATTENTION --cp 2,4`: a context-parallel attention proven against one process at cp 2 and
4 (causal and not, contiguous and zigzag), and each wrong version (tests/helpers/course_cp.py, written as students
write them) failed with its cause: blocks merged without their log-sum-exps, the causal mask wrong off the
diagonal, dK/dV not returned to their owners, a scrambled all-to-all, and a hang told by what each rank waited
for. torch's own deprecated differentiable all-gather, used the obvious way, is one of the wrong versions: on gloo
it scrambles a transposed gradient (dK)."""

import re

import pytest

from tests.e2e.test_check import check

HELPERS = "tests.helpers.course_cp"


def lines(out: str) -> dict:
    """(cp, case) -> (verdict, detail); (cp, "seen CASE") -> ("seen", what was seen)."""
    found = re.findall(r"^  (ok|FAIL|skip|seen)\s+cp (\d)  (\w+)\s+(.*)$", out, flags=re.M)
    return {(int(cp), f"seen {case}" if verdict == "seen" else case): (verdict, detail)
            for verdict, cp, case, detail in found}


def test_an_all_gather_attention_passes_every_case_at_cp_2_and_4(capsys):
    code, out, _ = check(f"{HELPERS}.all_gather_attention", "--cp", "2,4", capsys=capsys)
    found = lines(out)
    assert code == 0 and out.strip().endswith("every case passed (6)"), out
    seen = found[(4, "seen causal")][1]
    assert re.search(r"sent \d+, \d+, \d+, \d+ KiB by rank", seen) and "ring split: 1.73" in seen, seen


def test_ulysses_passes_and_a_function_without_a_layout_skips_zigzag(capsys):
    code, out, _ = check(f"{HELPERS}.ulysses_attention", "--cp", "2", capsys=capsys)
    found = lines(out)
    assert code == 0 and found[(2, "causal")][0] == found[(2, "full")][0] == "ok", out
    assert found[(2, "zigzag")] == ("skip", "not applicable: the function takes no `layout` keyword (add one to be "
                                            "checked on the zigzag split)"), out


@pytest.mark.parametrize("function, case, cause", [
    ("averages_blocks", "causal", "blocks merged without their log-sum-exps"),
    ("masks_every_block", "causal", "the causal mask wrong off the diagonal: earlier blocks masked"),
    ("keeps_own_grads", "causal", "dK/dV not returned to their owners"),
    ("ulysses_scrambled", "causal", "the right values in the wrong places (a scrambled exchange"),
    ("torch_all_gather_attention", "causal", "the output is right, the gradients are not: dk by up to"),
    ("receives_first", "causal", "still running after 5 s: every rank waits to receive and none sends"),
])
def test_each_wrong_attention_fails_with_its_cause(function, case, cause, capsys):
    code, out, _ = check(f"{HELPERS}.{function}", "--cp", "2", "--cases", case, "--timeout", "5", capsys=capsys)
    verdict, detail = lines(out)[(2, case)]
    assert code == 1 and verdict == "FAIL" and detail.split("FAILED: ")[1].startswith(cause), out


def test_a_hang_names_what_each_rank_waits_for(capsys):
    _, out, _ = check(f"{HELPERS}.receives_first", "--cp", "2", "--cases", "full", "--timeout", "5", capsys=capsys)
    detail = lines(out)[(2, "full")][1]
    assert "rank 0 waits to receive from rank 1; rank 1 waits to receive from rank 0" in detail, out


def test_float32_code_is_checked_in_float32(capsys):
    """`--dtype float32`, for code whose buffers take no other dtype (lucidrains' ring-attention-pytorch overflows
    filling a float32 buffer with float64's max): the right function passes within float32's rounding, a wrong one
    still gets its cause."""
    code, out, _ = check(f"{HELPERS}.all_gather_attention", "--cp", "2", "--dtype", "float32", capsys=capsys)
    assert code == 0 and "(float32, within 2e-05;" in out and out.strip().endswith("every case passed (3)"), out
    code, out, _ = check(f"{HELPERS}.averages_blocks", "--cp", "2", "--dtype", "float32", "--cases", "causal",
                         capsys=capsys)
    detail = lines(out)[(2, "causal")][1]
    assert code == 1 and "blocks merged without their log-sum-exps" in detail, out


@pytest.mark.parametrize("args, message", [
    (["--cp", "1"], "--cp takes ranks >= 2"),
    (["--cp", "2", "--tp", "2"], "one at a time"),
    (["--cp", "2", "--world-size", "2"], "--world-size is a data-parallel check's option"),
    (["--pp", "2", "--dtype", "float32"], "--dtype is the context-parallel and expert-parallel checks' option"),
])
def test_bad_input_is_refused_in_one_line(args, message, capsys):
    code, _, err = check(f"{HELPERS}.all_gather_attention", *args, capsys=capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
