"""`python -m ddp_lab.check`: it passes wrappers that train like one process and fails, naming the case
and the parameter, those that do not (tests/helpers/own_ddp.py: written as a CS336 student would)."""

import re
import subprocess
import sys

import pytest

from ddp_lab.check.__main__ import main
from tests.helpers.launching import ROOT


def check(*argv, capsys):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def verdicts(out: str) -> dict:
    """(world size, case) -> the line's verdict and detail."""
    found = re.findall(r"^  (ok|FAIL|skip)\s+(\d) ranks  (\w+)\s+(.*)$", out, flags=re.M)
    return {(int(ws), case): (verdict, detail) for verdict, ws, case, detail in found}


def test_a_hand_written_wrapper_passes_at_an_odd_world_size(capsys):
    code, out, _ = check("tests.helpers.own_ddp.AveragingDDP", "--world-size", "3", capsys=capsys)
    assert code == 0, out
    lines = verdicts(out)
    assert {case for (_, case), (v, _) in lines.items() if v == "ok"} == {"plain", "sgd", "frozen", "tied", "unused"}
    assert lines[(3, "accumulation")] == ("skip", "AveragingDDP has no no_sync()")
    assert lines[(3, "bucket")][0] == "skip"


@pytest.mark.parametrize("wrapper, case, expected", [
    ("ForgetsToAverage", "sgd", r"rank \d, \S+: max \|difference\| \S+ from the single-process reference"),
    ("SkipsFrozenBroadcast", "frozen", r"rank 1, frozen\.weight: max \|difference\| \S+ from rank 0's right after "
                                       r"wrapping \(the start-up broadcast\)"),
    ("DropsABucket", "bucket", r"rank \d, \S+: max \|difference\| \S+ from the single-process reference"),
])
def test_a_wrong_wrapper_fails_naming_the_case_and_the_parameter(wrapper, case, expected, capsys):
    code, out, _ = check(f"tests.helpers.own_ddp.{wrapper}", "--world-size", "2", "--cases", case, capsys=capsys)
    assert code == 1, out
    verdict, detail = verdicts(out)[(2, case)]
    assert verdict == "FAIL" and re.match(expected, detail), detail


def test_drops_a_bucket_passes_with_one_bucket(capsys):
    """The bucket case is what catches it: with one bucket (the default 25 MiB) nothing is dropped."""
    code, out, _ = check("tests.helpers.own_ddp.DropsABucket", "--world-size", "2", "--cases", "plain", capsys=capsys)
    assert code == 0, out


def test_a_hang_fails_after_the_timeout(capsys):
    code, out, _ = check("tests.helpers.own_ddp.WaitsForever", "--world-size", "2", "--cases", "plain",
                         "--timeout", "4", capsys=capsys)  # it never ends: any timeout shows it
    assert code == 1
    verdict, detail = verdicts(out)[(2, "plain")]
    assert verdict == "FAIL" and detail.startswith("still running after 4 s")


@pytest.mark.parametrize("argv, message", [
    (["no_such_module.DDP"], "error: cannot import 'no_such_module'"),
    (["ddp_lab.strategies.NoSuchDDP"], "error: 'ddp_lab.strategies' has no class 'NoSuchDDP'"),
    (["torch.nn.Linear"], "error: torch.nn.Linear has no finish_gradient_synchronization()"),
    (["ddp_lab.strategies.NaiveDDP", "--cases", "plain,nope"], "error: unknown case 'nope'"),
    (["ddp_lab.strategies.NaiveDDP", "--world-size", "1"], "error: --world-size takes ranks >= 2"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    code, _, err = check(*argv, capsys=capsys)
    assert code == 2
    assert err.startswith(message) and len(err.strip().splitlines()) == 1


def test_the_command_line_runs_our_own_strategy():
    proc = subprocess.run([sys.executable, "-m", "ddp_lab.check", "ddp_lab.strategies.BucketedDDP", "--world-size", "2",
                           "--cases", "bucket,accumulation"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every case passed (2)" in proc.stdout
