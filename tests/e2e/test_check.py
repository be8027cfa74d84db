"""`python -m ddp_lab.check`: it passes wrappers that train like one process and fails, naming the case
and the parameter, those that do not (tests/helpers/own_ddp.py: written as a CS336 student would)."""

import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from ddp_lab.check.__main__ import main
from ddp_lab.check.cases import CASES
from ddp_lab.check.ranks import run_ranks
from tests.helpers import own_ddp
from tests.helpers.launching import ROOT


def check(*argv, capsys, keep: bool = False):
    """main's exit code, stdout and stderr; the log folder a failure keeps is removed unless `keep`."""
    code = main(list(argv))
    out = capsys.readouterr()
    kept = re.search(r"the ranks' output and tracebacks: (\S+)$", out.out.strip())
    if kept and not keep:
        shutil.rmtree(kept.group(1))
    return code, out.out, out.err


def verdicts(out: str) -> dict:
    """(world size, case) -> the line's verdict and detail; (world size, "seen CASE") -> ("seen", what was
    seen)."""
    found = re.findall(r"^  (ok|FAIL|skip|seen)\s+(\d) ranks  ([\w@]+)\s+(.*)$", out, flags=re.M)
    return {(int(ws), f"seen {case}" if verdict == "seen" else case): (verdict, detail)
            for verdict, ws, case, detail in found}


def test_a_hand_written_wrapper_passes_at_an_odd_world_size(capsys):
    code, out, _ = check("tests.helpers.own_ddp.AveragingDDP", "--world-size", "3", capsys=capsys)
    assert code == 0, out
    assert f"torch {torch.__version__}, gloo on CPU" in out.splitlines()[0]
    for case in ("plain", "own_classes"):  # the lines under the verdicts: nothing sharded, nothing overlapped
        _, seen = verdicts(out)[(3, f"seen {case}")]
        assert re.match(r"per step \d+ collectives \(all_reduce \d+, [\d.]+ KiB per step, the largest [\d.]+ KiB\), "
                        r"none during backward", seen), seen
        assert seen.endswith("the largest rank holds 100% of the parameters, 100% of AdamW's state")
    lines = verdicts(out)
    passed = {case for (_, case), (v, _) in lines.items() if v == "ok"}
    assert passed == {"plain", "sgd", "own_classes", "frozen", "tied", "unused"}  # one run each: no bucket size
    assert lines[(3, "accumulation")] == ("skip", "AveragingDDP has no no_sync()")
    assert lines[(3, "groups")][0] == "skip"  # not an optimizer


@pytest.mark.parametrize("wrapper, case, expected", [
    ("ForgetsToAverage", "sgd", r"every rank agrees, and all differ from one process: .*: \S+.* differ \(rank \d, "
                                r"\S+: max \|difference\| \S+ from the single-process reference"),
    ("SkipsFrozenBroadcast", "frozen", r"the start-up broadcast: rank 1 began from its own weights \(frozen\.weight, "
                                       r"frozen\.bias differ from rank 0's right after wrapping; .*: --same-init\)"),
    ("DropsABucket", "plain@small", r"the ranks disagree after training \(.+\): a gradient was not averaged over "
                                    r"every rank"),
    ("GivesUnusedZeros", "unused", r"the unused parameter moved \(unused\.bias\): .*given a zero gradient"),
    ("TrainsFrozen", "frozen", r"a frozen parameter moved \(frozen\.bias\): .*: frozen\.weight, frozen\.bias.* differ"),
    ("BreaksTheTie", "tied", r"the tie is broken on rank \d: embed\.weight and out\.weight are one weight"),
])
def test_a_wrong_wrapper_fails_naming_the_cause_and_the_parameters(wrapper, case, expected, capsys):
    code, out, _ = check(f"tests.helpers.own_ddp.{wrapper}", "--world-size", "2", "--cases", case.split("@")[0],
                         capsys=capsys)
    assert code == 1, out
    verdict, detail = verdicts(out)[(2, case)]
    proves, _, why = detail.partition(": FAILED: ")
    assert verdict == "FAIL" and proves == CASES[case.split("@")[0]].proves and re.match(expected, why), detail


def test_a_crash_names_the_exception_and_the_users_line_and_costs_one_run_more(capsys, monkeypatch):
    """The tied case crashes in a gradient hook; the case before it keeps its result and the one after it runs
    in one more set of ranks. The ranks' output and the traceback are kept in the folder the last line names."""
    import ddp_lab.check.__main__ as cli

    runs = []
    monkeypatch.setattr(cli, "run_ranks", lambda *a, **k: runs.append(a[4]) or run_ranks(*a, **k))
    code, out, err = check("tests.helpers.own_ddp.CrashesOnTiedWeights", "--world-size", "2", "--cases",
                           "plain,tied,unused", "--traceback", capsys=capsys, keep=True)
    assert code == 1 and runs == [["plain", "tied", "unused"], ["unused"]], out
    lines = verdicts(out)
    assert lines[(2, "plain")][0] == lines[(2, "unused")][0] == "ok"
    source = inspect.getsource(own_ddp).splitlines()
    line = next(n for n, text in enumerate(source, 1) if ".view(-1).copy_" in text)
    assert re.search(r"FAILED: rank \d raised AttributeError: 'NoneType' object has no attribute 'view' "
                     rf"\(tests/helpers/own_ddp\.py:{line}, in _hook\)$", lines[(2, "tied")][1]), lines[(2, "tied")]
    assert "Traceback (most recent call last)" in err
    folder = Path(out.strip().splitlines()[-1].rsplit(": ", 1)[1])
    assert (folder / "traceback-2ranks-tied.txt").read_text().startswith("Traceback")
    assert {p.name for p in folder.glob("rank*.log")} == {"rank0.log", "rank1.log"}
    shutil.rmtree(folder)


def test_every_case_runs_at_the_courses_bucket_size_and_at_one_smaller_than_a_parameter(capsys):
    """Its constructor requires bucket_size_mb: each case runs at 25 MB (one bucket here: right) and at half the
    largest parameter (where it drops one); `--set` a size and the cases run at that one alone."""
    code, out, _ = check("tests.helpers.own_ddp.RequiresItsBucketSize", "--world-size", "2", "--cases",
                         "plain,frozen", capsys=capsys)
    lines = verdicts(out)
    assert code == 1 and "at 25 MB buckets, the course's (@25MB)" in out.splitlines()[0], out
    assert [lines[(2, run)][0] for run in ("plain@25MB", "frozen@25MB", "plain@small", "frozen@small")] == \
        ["ok", "ok", "FAIL", "FAIL"], out
    code, out, _ = check("tests.helpers.own_ddp.RequiresItsBucketSize", "--world-size", "2", "--cases", "plain",
                         "--set", "bucket_size_mb=25", capsys=capsys)
    assert code == 0 and list(verdicts(out)) == [(2, "plain"), (2, "seen plain")], out


def test_same_init_and_a_dtype_by_name(capsys):
    """--same-init: a wrapper that broadcasts nothing frozen passes where every rank starts alike; --set
    compute_dtype=float32 arrives as torch.float32."""
    code, out, _ = check("tests.helpers.own_ddp.SkipsFrozenBroadcast", "--world-size", "2", "--cases", "frozen",
                         "--same-init", capsys=capsys)
    assert code == 0, out
    code, out, _ = check("tests.helpers.own_ddp.TakesADtype", "--world-size", "2", "--cases", "plain", "--set",
                         "compute_dtype=float32", capsys=capsys)
    assert code == 0, out


def test_a_sharded_optimizer_is_checked_by_name_under_plain_ddp(capsys):
    """Ours keeps each group's options; one that puts every parameter in one group passes the plain case and
    fails the groups case."""
    code, out, _ = check("ddp_lab.strategies.ShardedOptimizer", "--world-size", "2", "--cases", "plain,groups",
                         capsys=capsys)
    lines = verdicts(out)
    assert code == 0 and lines[(2, "sharded")][0] == "ok", out  # claimed: a sharded optimizer
    held = float(re.search(r"holds 100% of the parameters, (\d+)% of AdamW's state", out).group(1))
    assert 30 < held < 70  # its shard: whole parameters to owners, about half
    code, out, _ = check("tests.helpers.own_ddp.ShardedOptimizerOneGroup", "--world-size", "2", "--cases",
                         "plain,groups", capsys=capsys)
    lines = verdicts(out)
    assert code == 1 and lines[(2, "plain")][0] == "ok" and lines[(2, "groups")][0] == "FAIL", out


def test_an_fsdp_that_shards_nothing_trains_right_and_fails_its_claim(capsys):
    """Read through gather_full_params() (so taken for an FSDP, which claims sharded parameters): its weights
    are right, and it holds every one whole."""
    code, out, _ = check("tests.helpers.own_ddp.GathersFullParams", "--world-size", "2", "--cases", "plain",
                         capsys=capsys)
    lines = verdicts(out)
    assert code == 1 and lines[(2, "plain")][0] == "ok", out
    assert lines[(2, "sharded")][1].split("FAILED: ")[1].startswith(
        "in plain rank 0 holds 100% of the parameters' bytes, more than 1/2 + 20% (70%): it shards no layer and holds "
        "Embedding, Linear, RMSNorm whole (does it pick its layers by a class")


def test_an_fsdp_of_the_courses_kind_passes_in_fp16_and_shards_the_users_layers(capsys):
    """No broadcast (--same-init), the course's own Linear and Embedding sharded, weights through
    gather_full_params(), computing in fp16 against a reference that rounds as it does; detected as an FSDP,
    so sharding is claimed and checked."""
    code, out, _ = check("tests.helpers.own_ddp.CourseFSDP", "--world-size", "2,3", "--same-init", "--set",
                         "compute_dtype=float16", capsys=capsys)
    assert code == 0, out
    assert "computes in float16 as it does" in out.splitlines()[0] and "read as an FSDP" in out.splitlines()[0]
    lines = verdicts(out)
    assert lines[(2, "sharded")][0] == lines[(3, "sharded")][0] == "ok"
    assert lines[(3, "seen own_classes")][1].endswith("sharded OwnEmbedding, OwnLinear, whole OwnRMSNorm")


@pytest.mark.parametrize("target, flags, expected", [
    ("KeyedOnTorchLayers", ["--same-init"], r"in own_classes rank \d holds 100% of the parameters' bytes, more than "
                                            r"1/2 \+ 20% \(70%\): it shards no layer and holds OwnEmbedding"),
    ("KeepsEveryState", [], r"in plain the ranks hold 200% of one AdamW's state between them \(rank 0 100%, rank 1 "
                            r"100%\), more than 100% \+ 20%: each piece is kept on more than one rank$"),
])
def test_what_shards_nothing_fails_the_claim_it_makes(target, flags, expected, capsys):
    """An FSDP keyed on torch's classes shards nothing of the course's kind of model; a "sharded" optimizer that
    keeps every state: both train right, and both claim sharding by what they are."""
    code, out, _ = check(f"tests.helpers.own_ddp.{target}", "--world-size", "2", "--cases", "plain,own_classes",
                         *flags, capsys=capsys)
    lines = verdicts(out)
    assert code == 1 and lines[(2, "plain")][0] == lines[(2, "own_classes")][0] == "ok", out
    verdict, detail = lines[(2, "sharded")]
    assert verdict == "FAIL" and re.search(expected, detail.split(": FAILED: ")[1]), detail


@pytest.mark.parametrize("target, expected", [
    ("AveragingDDP", {"overlap": "in plain no collective was issued during backward",
                      "bucketed": "in plain 17 collectives per step for 17 trainable tensors"}),
    ("IgnoresItsBucketSize", {"bucketed": "1 collective per step with buckets of half the largest parameter "
                                          r"\(plain@small\), 1 with 25 MB \(plain@25MB\): the bucket size is not "
                                          "honoured"}),
])
def test_a_claim_the_wrapper_does_not_keep_fails(target, expected, capsys):
    code, out, _ = check(f"tests.helpers.own_ddp.{target}", "--world-size", "2", "--cases", "plain", "--expect",
                         ",".join(expected), capsys=capsys)
    lines = verdicts(out)
    assert code == 1 and all(v == "ok" for (_, run), (v, _) in lines.items() if run.startswith("plain")), out
    for prop, why in expected.items():
        verdict, detail = lines[(2, prop)]
        assert verdict == "FAIL" and re.match(why, detail.split(": FAILED: ")[1]), detail


def test_a_sum_for_a_mean_fails_in_fp16_too(capsys):
    """The compute dtype's wider tolerance still sees a missing division, where SGD shows it, and blames the average:
    its float32 twin fails too."""
    code, out, _ = check("tests.helpers.own_ddp.ForgetsToAverageFSDP", "--world-size", "2", "--same-init", "--cases",
                         "sgd", "--set", "compute_dtype=float16", capsys=capsys)
    verdict, detail = verdicts(out)[(2, "sgd")]
    assert code == 1 and verdict == "FAIL" and "the average is wrong (a sum for a mean" in detail, out


def test_a_rounding_of_its_own_is_never_blamed_on_the_average(capsys):
    """An FSDP that divides and sums its gradients in fp16 (as torch's fp16_compress_hook does) rounds more than the
    reference: each parameter's tolerance is twice how far one rounding per step moves it, so at 2 ranks it passes
    and at 3 its qkv weight still differs; its float32 twin passes, so the line says the average is right (the check
    before it said "the average is wrong" over 10 parameters at 3 ranks, the embedding by 0.0074)."""
    code, out, _ = check("tests.helpers.own_ddp.AveragesInItsDtype", "--world-size", "2,3", "--same-init", "--cases",
                         "plain,sgd", "--set", "compute_dtype=float16", capsys=capsys)
    lines = verdicts(out)
    assert "twice how far one rounding of each step's gradients in float16 moves it" in out.splitlines()[0], out
    assert [lines[(n, c)][0] for n in (2, 3) for c in ("plain", "sgd")] == ["ok", "ok", "FAIL", "ok"], out
    detail = lines[(3, "plain")][1]
    assert "the average is wrong" not in detail and "the same case passes in float32, so the average is right" in detail
    assert re.search(r"tolerance \d\.\d+: twice how far one rounding", detail) and "embed.weight" not in detail, detail


def test_a_hang_fails_after_the_timeout(capsys):
    code, out, _ = check("tests.helpers.own_ddp.WaitsForever", "--world-size", "2", "--cases", "plain",
                         "--timeout", "4", capsys=capsys)  # it never ends: any timeout shows it
    assert code == 1
    verdict, detail = verdicts(out)[(2, "plain")]
    assert verdict == "FAIL" and detail.split(": FAILED: ")[1].startswith("still running after 4 s")


def test_a_rank_that_dies_joining_the_group_is_named_not_taken_for_a_hang(tmp_path):
    """A false verdict on public code: a rank whose gloo cannot find its network interface dies in
    init_process_group, before the wrapper runs. The check said "still running after 120 s" in a run of 5 s (the
    rank joined before its error file was in place, and a failure without one was taken for a timeout). Its own
    process: the fork server keeps the environment of the first check in a process."""
    proc = subprocess.run([sys.executable, "-m", "ddp_lab.check", "tests.helpers.own_ddp.AveragingDDP",
                           "--world-size", "2", "--cases", "plain", "--logs", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "GLOO_SOCKET_IFNAME": "nope"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    detail = verdicts(proc.stdout)[(2, "plain")][1].split(": FAILED: ")[1]
    assert detail.startswith("rank ") and " died joining the process group, before any of the checked code ran: " \
        "RuntimeError: " in detail and "Unable to find address for: nope" in detail, detail
    assert detail.endswith("(set here: GLOO_SOCKET_IFNAME=nope)") and "still running" not in proc.stdout, detail


@pytest.mark.parametrize("argv, message", [
    (["no_such_module.DDP"], "error: cannot import 'no_such_module'"),
    (["ddp_lab.strategies.NoSuchDDP"], "error: 'ddp_lab.strategies' has no class 'NoSuchDDP'"),
    (["torch.nn.Linear"], "error: torch.nn.Linear has no finish_gradient_synchronization()"),
    (["ddp_lab.strategies.NaiveDDP", "--cases", "plain,nope"], "error: unknown case 'nope'"),
    (["ddp_lab.strategies.NaiveDDP", "--world-size", "1"], "error: --world-size takes ranks >= 2"),
    (["ddp_lab.strategies.NaiveDDP", "--expect", "fast"], "error: --expect 'fast' is no property"),
    (["ddp_lab.strategies.NaiveDDP", "--layers", "conv=torch.nn.Conv1d"], "error: --layers conv=...: the kinds are"),
    (["ddp_lab.strategies.NaiveDDP", "--layers", "linear=torch.nn.Nope"],
     "error: --layers linear=torch.nn.Nope: not a"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    code, _, err = check(*argv, capsys=capsys)
    assert code == 2
    assert err.startswith(message) and len(err.strip().splitlines()) == 1


def test_the_command_line_runs_our_own_strategy():
    proc = subprocess.run([sys.executable, "-m", "ddp_lab.check", "ddp_lab.strategies.BucketedDDP", "--world-size", "2",
                           "--cases", "plain", "--expect", "bucketed,overlap"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every case passed (4)" in proc.stdout  # a case at two bucket sizes, two claims
    assert "with gradients still to come (those can overlap it)" in proc.stdout  # its buckets go while backward runs
    seen = verdicts(proc.stdout)  # what each bucket size did, the claims read from both
    assert seen[(2, "seen plain@25MB")][1].startswith("per step 1 collective") and \
        ", 0 launched asynchronously" in seen[(2, "seen plain@25MB")][1], proc.stdout
    assert re.search(r", [1-9]\d* launched asynchronously", seen[(2, "seen plain@small")][1]), proc.stdout


# --- code written to the course's spec (docs/check.md, "Code written for the course") -----------------------------

COURSE_LAYERS = ["--layers", "linear=tests.helpers.course_layers.Linear,"
                 "embedding=tests.helpers.course_layers.Embedding,norm=tests.helpers.course_layers.RMSNorm"]


@pytest.mark.parametrize("target, cases", [("RoundRobinSharded", ",".join(CASES)),  # every model the check has
                                           ("ShardedInAList", "plain,own_classes,groups")])
def test_a_round_robin_sharded_optimizer_passes_whatever_its_inner_optimizer_is_called(target, cases, capsys):
    """Whole parameters dealt round-robin (the course's method), the inner optimizer as `_local_optimizer` or in a
    list: its state is found and measured, and one rank holding 98% of it (own_classes at 2 ranks: tensors alternate
    large and tiny) is no fault of the dealing."""
    code, out, _ = check(f"tests.helpers.own_ddp.{target}", "--world-size", "2,3", "--cases", cases, capsys=capsys)
    lines = verdicts(out)
    assert code == 0 and lines[(2, "sharded")][0] == lines[(3, "sharded")][0] == "ok", out
    assert "98% of AdamW's state" in lines[(2, "seen own_classes")][1], out


def test_an_optimizer_that_keeps_every_state_fails_sharded_whatever_its_inner_optimizer_is_called(capsys):
    code, out, _ = check("tests.helpers.own_ddp.KeepsEveryStateAsOptimizer", "--world-size", "2", "--cases", "plain",
                         capsys=capsys)
    verdict, detail = verdicts(out)[(2, "sharded")]
    assert code == 1 and verdict == "FAIL" and "the ranks hold 200% of one AdamW's state between them" in detail, out


@pytest.mark.parametrize("target, cases, cause", [
    ("DropsFirstGroupOptions", "plain,groups", "a parameter was not stepped with its own group's options"),
    ("NeverSendsTheLastGroup", "groups", "a parameter's update was not sent from the rank that owns it"),
    ("AveragesParametersAfterStep", "plain,groups", "an update is not its owner's alone"),
])
def test_a_sharded_optimizers_fault_gets_an_optimizers_cause(target, cases, cause, capsys):
    """Under the check's own DDP the gradients are averaged right, so a fault points at the updates: one averaged
    with the other ranks' stale copies is not blamed on an average or (where plain fails too) on group options;
    group options are blamed where plain passes."""
    code, out, _ = check(f"tests.helpers.own_ddp.{target}", "--world-size", "2", "--cases", cases, capsys=capsys)
    lines = verdicts(out)
    verdict, detail = lines[(2, "groups")]
    assert code == 1 and verdict == "FAIL" and cause in detail, out
    assert "a gradient was not averaged" not in detail and "the average is wrong" not in detail
    if target == "AveragesParametersAfterStep":
        assert cause in lines[(2, "plain")][1] and "group's options" not in detail.split("FAILED: ")[1], out


def test_an_unused_parameter_that_holds_its_bucket_back_is_named_as_the_cause(capsys):
    code, out, _ = check("tests.helpers.own_ddp.HeldBackByUnused", "--world-size", "2", "--cases", "unused",
                         capsys=capsys)
    verdict, detail = verdicts(out)[(2, "unused")]
    assert code == 1 and verdict == "FAIL", out
    assert "FAILED: the unused parameter (unused.bias, unused.weight) held back what was to be sent with it" in detail


def test_an_fsdp_of_the_courses_own_classes_is_checked_on_models_built_of_them(capsys):
    """isinstance on the course's Linear and Embedding: on torch's layers it shards nothing, and the line says why;
    built of its classes (--layers) it shards them, and its frozen, tied and fp16 cases run and pass (2 ranks)."""
    code, out, _ = check("tests.helpers.course_layers.IsinstanceFSDP", "--world-size", "2", "--same-init", "--cases",
                         "plain", capsys=capsys)
    assert code == 1 and "Give it yours with --layers" in verdicts(out)[(2, "sharded")][1], out
    code, out, _ = check("tests.helpers.course_layers.IsinstanceFSDP", "--world-size", "2", "--same-init", "--cases",
                         "plain,own_classes,frozen,tied", "--set", "compute_dtype=float16", *COURSE_LAYERS,
                         capsys=capsys)
    lines = verdicts(out)
    assert code == 0 and all(lines[(2, c)][0] == "ok" for c in ("plain", "own_classes", "frozen", "tied", "sharded"))
    assert lines[(2, "seen plain")][1].endswith("sharded Embedding, Linear, whole RMSNorm"), out


def test_an_fsdp_with_the_courses_frozen_bug_fails_naming_it(capsys):
    code, out, _ = check("tests.helpers.course_layers.AveragesFrozenToo", "--world-size", "2", "--same-init",
                         "--cases", "frozen", *COURSE_LAYERS, capsys=capsys)
    verdict, detail = verdicts(out)[(2, "frozen")]
    assert code == 1 and verdict == "FAIL" and "FAILED: a frozen parameter moved (frozen.weight)" in detail, out


@pytest.mark.parametrize("target", ["GathersNamedParameters", "RenamesItsShard"])
def test_a_gather_of_named_parameters_and_a_renamed_shard(target, capsys):
    """A tied weight listed once by named_parameters() is filled from its other name; a shard kept as `weight_shard`
    is seen as sharding by what the layer holds."""
    code, out, _ = check(f"tests.helpers.own_ddp.{target}", "--world-size", "2", "--same-init", "--cases",
                         "tied,plain", capsys=capsys)
    lines = verdicts(out)
    assert code == 0 and lines[(2, "tied")][0] == "ok", out
    assert lines[(2, "seen plain")][1].endswith("sharded Embedding, Linear, whole RMSNorm"), out


def test_claims_say_what_was_seen(capsys):
    """One bucket size given: the bucketed line claims nothing about smaller buckets. Collectives issued only in the
    last gradient hook: issued during backward, with nothing left to overlap."""
    code, out, _ = check("tests.helpers.own_ddp.IgnoresItsBucketSize", "--world-size", "2", "--cases", "plain",
                         "--set", "bucket_size_mb=1", "--expect", "bucketed", capsys=capsys)
    assert verdicts(out)[(2, "bucketed")][1].endswith("fewer collectives than tensors at the bucket size given"), out
    code, out, _ = check("tests.helpers.own_ddp.AveragesInTheLastHook", "--world-size", "2", "--cases", "plain",
                         "--expect", "overlap", capsys=capsys)
    verdict, detail = verdicts(out)[(2, "overlap")]
    assert code == 1 and verdict == "FAIL" and "nothing was left for it to overlap" in detail, out


def test_a_blocking_all_reduce_in_each_hook_is_not_overlap(capsys):
    """A collective called without async_op in a gradient hook stops backward until it is done: issued during
    backward with gradients still to come, it overlaps nothing, and the check says why (it used to count 16 of
    17 as overlapping)."""
    code, out, _ = check("tests.helpers.own_ddp.BlocksInEveryHook", "--world-size", "2", "--cases", "plain",
                         "--expect", "overlap", capsys=capsys)
    lines = verdicts(out)
    assert code == 1 and lines[(2, "plain")][0] == "ok", out
    verdict, detail = lines[(2, "overlap")]
    assert verdict == "FAIL" and "called without async_op=True in a gradient hook, backward waits for each" in detail
    assert "17 of them issued during backward, all blocking (backward waits for each), 0 launched" in \
        lines[(2, "seen plain")][1], out


@pytest.mark.parametrize("target, cause", [
    ("KeepsGatheredWeights", r"it keeps the gathered weights after forward \(12 whole weights in self\.full_params, "
                             r"\d+% of the parameters"),
    ("ShardIsAView", r"the shard is a view of the whole weight \(module\.\S+ and 11 more: 6\.0 KiB, its storage "
                     r"12\.0 KiB"),
    ("KeepsGatheredInAHook", r"it keeps the gathered weights after forward \(12 whole weights in "
                             r"self\.module\._forward_pre_hooks\[\d+\]\.remember\.last_forward, \d+%"),
])
def test_an_fsdp_holding_whole_weights_at_rest_fails_sharded_by_what_it_holds(target, cause, capsys):
    """Memory measured, not elements counted: a dict of every gathered weight kept on the wrapper or in a hook's
    closure, and a shard that is a slice of the whole weight, all hold 1/N of the elements in their parameters and
    train right; each storage counted once and whole shows what they hold (150% and 100% at 2 ranks), with the
    cause and where."""
    code, out, _ = check(f"tests.helpers.own_ddp.{target}", "--world-size", "2", "--same-init", "--cases", "plain",
                         capsys=capsys)
    lines = verdicts(out)
    assert code == 1 and lines[(2, "plain")][0] == "ok", out
    verdict, detail = lines[(2, "sharded")]
    assert verdict == "FAIL" and re.search(r"in plain rank \d holds 1[05]0% of the parameters' bytes, more than 1/2 "
                                           r"\+ 20% \(70%\): " + cause, detail), detail
    held = {"KeepsGatheredWeights": r"50% of the parameters \(and keeps 99% more beside them, in self\.full_params\)",
            "KeepsGatheredInAHook": r"50% of the parameters \(and keeps 99% more beside them, in "
                                    r"self\.module\._forward_pre_hooks\[\d+\]\.remember\.last_forward\)",
            "ShardIsAView": "100% of the parameters"}[target]
    assert re.search(f"the largest rank holds {held}, 50% of AdamW's state", lines[(2, "seen plain")][1]), out


def test_two_faults_in_one_run_are_both_named(capsys):
    """A broken tie and a bias never averaged: the tie explains its own names, and the ranks disagreeing on the bias
    is a fault of its own (what merely trained on different weights is not blamed on a second cause)."""
    code, out, _ = check("tests.helpers.own_ddp.UntiesAndSkipsABias", "--world-size", "2", "--cases", "tied",
                         capsys=capsys)
    detail = verdicts(out)[(2, "tied")][1].split("FAILED: ")[1]
    assert code == 1 and detail.startswith("the tie is broken on rank 0: embed.weight and out.weight are one"), out
    assert "; and the ranks disagree after training (hidden.bias): a gradient was not averaged" in detail, out
    code, out, _ = check("tests.helpers.own_ddp.BreaksTheTie", "--world-size", "2", "--cases", "tied", capsys=capsys)
    assert "; and " not in verdicts(out)[(2, "tied")][1], out  # one fault, one cause


def test_a_failing_run_leaves_nothing_in_the_working_directory(tmp_path):
    """Its logs go to a folder it names, in the system's temporary directory or under --logs, and nowhere else;
    a passing run keeps none."""
    work, logs = tmp_path / "work", tmp_path / "logs"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(target, *flags):
        return subprocess.run([sys.executable, "-m", "ddp_lab.check", f"tests.helpers.own_ddp.{target}",
                               "--world-size", "2", "--cases", "plain", *flags], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)

    failed = run("DropsABucket", "--set", "bucket_size_mb=0.001")
    assert failed.returncode == 1 and list(work.iterdir()) == [], failed.stdout + failed.stderr
    kept = Path(re.search(r"the ranks' output and tracebacks: (\S+)$", failed.stdout.strip()).group(1))
    assert kept.parent == Path(tempfile.gettempdir()) and (kept / "rank0.log").exists()
    shutil.rmtree(kept)
    failed = run("DropsABucket", "--set", "bucket_size_mb=0.001", "--logs", str(logs))
    assert failed.returncode == 1 and failed.stdout.strip().endswith(f"tracebacks: {logs}"), failed.stdout
    assert sorted(p.name for p in logs.iterdir()) == ["rank0.log", "rank1.log", "spawn.log"]
    passed = run("AveragingDDP", "--logs", str(logs))
    assert passed.returncode == 0 and list(logs.iterdir()) == [] and list(work.iterdir()) == [], passed.stdout


def test_a_dict_keyed_by_layers_whose_repr_raises_gets_the_verdict_its_bugs_deserve(capsys):
    """The check walks what a wrapper keeps to measure it; it used to name a dict's entries by repr() of the key, and
    a layer whose extra_repr reads a weight the FSDP removes between forwards raised inside the check, failing every
    case with the user's AttributeError and hiding the real bug. Keys are named without calling the user's code:
    the frozen layer that trains (every shard made trainable again) is the only cause told."""
    code, out, _ = check("tests.helpers.own_ddp.KeysByLayerMovesFrozen", "--world-size", "2", "--same-init",
                         "--layers", "linear=tests.helpers.own_ddp.WholeWeightLinear", "--cases", "sgd,frozen",
                         capsys=capsys)
    lines = verdicts(out)
    assert code == 1 and "AttributeError" not in out and "extra_repr" not in out, out
    assert lines[(2, "sgd")][0] == "ok", out
    verdict, detail = lines[(2, "frozen")]
    assert verdict == "FAIL" and "a frozen parameter moved (frozen." in detail, out
