"""`python -m ddp_lab.check SCHEDULE --pp 2,4`: a pipeline schedule proven against one process at 2 and 4 stages
with 1, 2 and 4 micro-batches and a weight tied across stages, and each wrong version (tests/helpers/course_pp.py,
the lecture's homework as students complete it) failed with its cause: the loss divided by the micro-batch count
not at all or twice, activations not kept until backward, a tie not summed, and a hang told by what each stage
waited for."""

import re

import pytest

from tests.e2e.test_check import check

HELPERS = "tests.helpers.course_pp"


def lines(out: str) -> dict:
    """(pp, case) -> (verdict, detail); (pp, "seen CASE") -> ("seen", what was seen)."""
    found = re.findall(r"^  (ok|FAIL|skip|seen)\s+pp (\d)  (\w+)\s+(.*)$", out, flags=re.M)
    return {(int(pp), f"seen {case}" if verdict == "seen" else case): (verdict, detail)
            for verdict, pp, case, detail in found}


def worth(seen: str) -> list[float]:
    """Each stage's activation peak, in micro-batches' worth, from a seen line."""
    return [float(w) for w in re.findall(r"\(([\d.]+) micro-batches' worth\)", seen)]


@pytest.mark.parametrize("schedule", ["gpipe", "one_f_one_b"])
def test_gpipe_and_1f1b_pass_at_2_and_4_stages(schedule, capsys):
    code, out, _ = check(f"{HELPERS}.{schedule}", "--pp", "2,4", capsys=capsys)
    found = lines(out)
    assert code == 0 and out.strip().endswith("every case passed (8)"), out
    seen = found[(4, "seen m4")][1]
    bubbles = re.findall(r"stage \d bubble (\d+)% \((\d+)-(\d+)%\)", seen)  # the median, within its range
    assert len(bubbles) == 4 and all(int(lo) <= int(mid) <= int(hi) for mid, lo, hi in bubbles), seen
    assert "(p - 1) / (m + p - 1) = 43% at p 4, m 4" in seen and "over 7 steps, each started on every stage" in seen
    if schedule == "one_f_one_b":  # in flight: min(m, p - stage) micro-batches, the last stage's loss one more
        assert worth(seen)[:3] == [4.0, 3.0, 2.0] and worth(seen)[3] == 1.0, seen
    else:  # every micro-batch held until the backward phase
        assert worth(seen)[1:3] == [4.0, 4.0], seen


@pytest.mark.parametrize("schedule, cause", [
    ("loss_not_divided", "the loss is not divided by the micro-batch count: every gradient is {m} times one "
                         "process's"),
    ("divided_twice", "the loss is divided by the micro-batch count twice: every gradient is 1/{m} of one process's"),
    ("frees_its_outputs", "a micro-batch's activations were freed before its backward"),
])
def test_each_wrong_schedule_fails_with_its_cause(schedule, cause, capsys):
    code, out, _ = check(f"{HELPERS}.{schedule}", "--pp", "2", "--cases", "m1,m2,m4", capsys=capsys)
    found = lines(out)
    assert code == 1, out
    for m in (2, 4):
        verdict, detail = found[(2, f"m{m}")]
        assert verdict == "FAIL" and detail.split("FAILED: ")[1].startswith(cause.format(m=m)), out
    assert found[(2, "m1")][0] == ("FAIL" if schedule == "frees_its_outputs" else "ok"), out  # m = 1 hides a scale


def test_a_1f1b_whose_warmup_is_not_capped_fails_where_m_is_below_p_minus_1(capsys):
    """Right at 2 stages and at m >= p - 1; at 4 stages with 1 or 2 micro-batches its first stage asks for one that
    does not exist, and the line says why (the check before this one gave the IndexError alone)."""
    code, out, _ = check(f"{HELPERS}.warmup_not_capped", "--pp", "2,4", "--cases", "m1,m2,m4", capsys=capsys)
    found = lines(out)
    assert code == 1 and [found[(p, f"m{m}")][0] for p in (2, 4) for m in (1, 2, 4)] == \
        ["ok", "ok", "ok", "FAIL", "FAIL", "ok"], out
    for m in (1, 2):
        assert found[(4, f"m{m}")][1].split("FAILED: ")[1].startswith(
            f"a stage asked for a micro-batch that does not exist (m {m} < p - 1 = 3: a 1F1B's warm-up is "
            "min(p - 1 - rank, m) forwards, not p - 1 - rank): rank 0 raised IndexError"), out


def test_a_tie_not_summed_across_stages(capsys):
    code, out, _ = check(f"{HELPERS}.forgets_the_tie", "--pp", "2,4", "--cases", "m2,tied", capsys=capsys)
    found = lines(out)
    assert code == 1 and found[(2, "m2")][0] == found[(4, "m2")][0] == "ok", out
    for pp in (2, 4):
        assert f"FAILED: a tied weight's copies on stages 0 and {pp - 1} were not summed (embed.weight, head.weight" \
            in found[(pp, "tied")][1], out


def test_sends_and_receives_in_a_different_order_hang_and_are_told(capsys):
    code, out, _ = check(f"{HELPERS}.receives_in_reverse", "--pp", "2,4", "--cases", "m2", "--timeout", "5",
                         capsys=capsys)
    found = lines(out)
    assert code == 1, out
    for pp in (2, 4):
        detail = found[(pp, "m2")][1].split("FAILED: ")[1]
        assert detail.startswith("still running after 5 s: sends and receives paired in a different order: stage 0 "
                                 "sends tag 0 while stage 1 waits for tag 1"), out
        assert "stage 1 waits to receive its 1st activation from stage 0 (micro-batch 0 in order, tag 1)" in detail


@pytest.mark.parametrize("argv, message", [
    ([f"{HELPERS}.gpipe", "--pp", "1"], "error: --pp takes ranks >= 2"),
    ([f"{HELPERS}.nope", "--pp", "2"], "error: 'tests.helpers.course_pp' has no schedule function 'nope'"),
    ([f"{HELPERS}.gpipe", "--pp", "2", "--tp", "2"], "error: --tp checks a pair of layers, --pp a schedule"),
    ([f"{HELPERS}.gpipe", "--pp", "2", "--cases", "plain"], "error: unknown case 'plain'; cases: m1, m2, m4, tied"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    code, _, err = check(*argv, capsys=capsys)
    assert code == 2 and err.startswith(message) and len(err.strip().splitlines()) == 1, err


def test_the_gpipe_docs_show_is_the_one_the_suite_checks():
    """docs/check_pp.md's worked example is tests/helpers/course_pp.gpipe, line for line (its docstring aside)."""
    import inspect
    from pathlib import Path

    from tests.helpers import course_pp
    from tests.helpers.launching import ROOT

    docs = (Path(ROOT) / "docs" / "check_pp.md").read_text()
    shown = docs[docs.index("def gpipe(stage, step) -> None:"):]
    shown = shown[:shown.index("```")].rstrip()
    source = inspect.getsource(course_pp.gpipe)
    docstring = f'    """{course_pp.gpipe.__doc__}"""\n'
    assert source.replace(docstring, "").rstrip() == shown


def test_a_schedule_over_p2pops_and_batch_isend_irecv_is_watched_and_checked(capsys):
    """Most real pipelines talk through `P2POp`s and `batch_isend_irecv` (torch's own stages do): the watch replaced
    torch.distributed's isend and irecv, which P2POp compares its op with distributed_c10d's own by identity, so
    every such schedule failed with 'Invalid op' on its correct line. One wrapper now stands in both places and
    reads the peer from group_peer too: the right schedule passes, a real bug (the loss never divided by the
    micro-batch count) gets its cause."""
    code, out, _ = check(f"{HELPERS}.gpipe_batched", "--pp", "2,4", "--cases", "m2,tied", capsys=capsys)
    assert code == 0 and out.strip().endswith("every case passed (4)"), out
    # 1F1B as Megatron posts it: a forward's send and an earlier micro-batch's gradient receive in one batch
    code, out, _ = check(f"{HELPERS}.one_f_one_b_batched", "--pp", "2,4", "--cases", "m1,m4,tied", capsys=capsys)
    assert code == 0 and out.strip().endswith("every case passed (6)"), out
    code, out, _ = check(f"{HELPERS}.batched_loss_not_divided", "--pp", "2", "--cases", "m2", capsys=capsys)
    verdict, detail = lines(out)[(2, "m2")]
    assert code == 1 and verdict == "FAIL" and "the loss is not divided by the micro-batch count: every gradient is " \
        "2 times one process's" in detail, out


def test_a_schedule_that_declares_no_ties_is_not_applicable_to_the_tied_case(capsys):
    """`supports_ties = False`: the tied case is a skip, said so, never an ok; the summary counts the skip apart;
    the m4 case says the stage count it ran at."""
    code, out, _ = check(f"{HELPERS}.gpipe_without_ties", "--pp", "2", "--cases", "m4,tied", capsys=capsys)
    found = lines(out)
    assert code == 0 and out.strip().endswith("every case passed (1), skipped (1)"), out
    assert found[(2, "tied")] == ("skip", "not applicable: the schedule declares it does not support a weight tied "
                                          "across stages (supports_ties = False)"), out
    assert found[(2, "m4")][1].startswith("four micro-batches over 2 stages: more than a 1F1B's first stage holds"), out
