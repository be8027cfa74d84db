"""Failures end in a clear, recorded status, through launch.py with real torchrun and gloo ranks.

Each test waits for a state (a file, a process), never for a duration, so a busy machine makes
them slower but not flaky. `fault.*` (ddp_lab/faults.py) makes the failure happen on purpose.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.launching import FAST, ROOT, launch, results
from tests.helpers.processes import leftovers, rank_pid, wait_for
from tests.helpers.wandb_records import _payloads, run_file_of_job

pytestmark = pytest.mark.slow
QUIET = [*FAST, "logger=none"]


def wandb_exit_code(job_dir):
    """The exit record of the job's offline W&B run: present only if the run was closed."""
    from wandb.proto import wandb_internal_pb2

    with open(run_file_of_job(job_dir), "rb") as f:
        for payload in _payloads(f.read()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            if record.WhichOneof("record_type") == "exit":
                return record.exit.exit_code
    return None


def test_crash_fails_its_job_and_the_sweep_goes_on(crash_sweep):
    """zero2 runs the lab's rings on gloo (backend.collectives): rank 1 crashes while rank 0 is in a ring;
    its wait fails (the peer's connection closed) and the job ends failed, naming the cause. The session's
    crash sweep (tests/e2e/conftest.py): jobs 1 and 3 crash, 0 and 2 run before and between them."""
    proc, sweep, jobs = crash_sweep
    assert [jobs[i]["status"] for i in range(4)] == ["ok", "failed", "ok", "failed"]
    for failed in (jobs[1], jobs[3]):
        assert failed["error"] == "rank 1: InjectedFault: injected crash at step 2"  # the rank and the cause
        assert [s["step"] for s in failed["steps"]] == [0, 1]  # the steps measured before the crash are kept
        assert failed["summary"]["injected"] == {"kind": "crash", "rank": 1, "step": 2}  # the launcher wrote it
    assert proc.returncode == 1  # the sweep says something failed ...
    assert "2 of 4 jobs did not end ok: 1, 3" in proc.stderr  # ... and its table which
    table = [line for line in proc.stdout.splitlines() if line.startswith("│ ")]
    assert ["failed" in line for line in table[-4:]] == [False, True, False, True]
    assert leftovers(sweep.parent) == []


def test_a_slow_rank_ends_ok_and_its_run_says_it_was_slowed(crash_sweep):
    """fault.kind=slow: the jobs of the crash sweep that do not crash have rank 1 a 3x straggler from step 2;
    the record names the injection and each slowed step the time it added (not how long a step took)."""
    _, _, jobs = crash_sweep
    for slowed in (jobs[0], jobs[2]):
        assert slowed["status"] == "ok"
        assert slowed["summary"]["injected"] == {"kind": "slow", "rank": 1, "step": 2, "slowdown": 3.0}
        delays = {s["step"]: s.get("injected_delay_ms") for s in slowed["steps"]}
        assert delays[0] is None and delays[1] is None and delays[2] > 0 and delays[3] > 0
        # The verdict and its evidence from every rank's collective stamps (docs/scale.md): 3 measured steps at
        # 2 ranks are too few to tell a straggler from chance, and it says so rather than name one (before the
        # consistency test, CI saw rank 0 named here once: the contention of 2 cores outweighed rank 1's delay).
        # The verdict is proved on a known 200 ms delay (tests/parity/test_skew.py) and graded on a quiet
        # machine (docs/benchmarks.md, "Stragglers").
        straggler = slowed["summary"]["straggler"]
        assert straggler["rank"] is None and len(straggler["per_rank"]["blame_ms"]) == 2, straggler
        assert straggler["why"] == "3 measured steps cannot tell a straggler from chance (2 ranks need 8)"
        assert all({"skew_ms", "peer_wait_ms", "transfer_ms"} <= set(s) for s in slowed["steps"])


@pytest.fixture(scope="module")
def oom_and_hang(tmp_path_factory) -> tuple:
    """One sweep, zero2 on the lab's rings with backend.timeout_s=10: rank 1 runs out of memory at step 1 (job
    0), rank 1 hangs at step 1 (job 1). (seconds the sweep took, its folder)."""
    tmp = tmp_path_factory.mktemp("oom_and_hang")
    start = time.monotonic()
    proc = launch(*QUIET, "strategy=zero2", "fault.kind=oom,hang", "fault.rank=1", "fault.step=1",
                  "backend.timeout_s=10", tmp_path=tmp, multirun=True, timeout=240)
    assert proc.returncode == 1, proc.stderr[-2000:]
    return time.monotonic() - start, tmp


def test_out_of_memory_is_reported_as_such(oom_and_hang):
    _, tmp = oom_and_hang
    assert results(tmp / "multirun" / "0")["error"].startswith("rank 1: out of memory: ")


def test_hung_rank_is_ended_by_the_collective_timeout(oom_and_hang):
    """zero2 on the lab's rings: rank 0 waits in a ring for rank 1, which hangs; the group's timeout ends
    the wait and the job (gloo's own all-reduce over emulated links ends the same way, through the same
    teardown as a crash: tests/e2e/test_emulated_network.py)."""
    took, tmp = oom_and_hang
    assert took < 90  # both jobs: the hung one ended at the timeout, not by the test's own limit
    res = results(tmp / "multirun" / "1")
    assert res["status"] == "failed"
    assert res["error"].startswith("rank 0: collective timed out after backend.timeout_s=10 s, rank 1 never joined it")
    assert leftovers(tmp) == []


def test_every_rank_hung_outside_a_collective_is_ended_by_the_watchdog(tmp_path):
    """No collective is waiting, so no timeout fires: the launcher's watchdog is the last resort."""
    proc = launch(*QUIET, "fault.kind=hang", "fault.rank=-1", "fault.step=1", "launcher.watchdog_s=8",
                  tmp_path=tmp_path, timeout=120)
    assert proc.returncode == 1
    res = results(tmp_path / "run")
    assert res["status"] == "failed" and res["error"].startswith("launcher.watchdog_s=8:")
    assert leftovers(tmp_path) == []


def test_rank_killed_without_a_word_is_named_with_its_signal(tmp_path):
    """What the kernel's OOM killer does (SIGKILL): the rank and the signal, not a bare exit code."""
    job = tmp_path / "run"
    args = [sys.executable, str(ROOT / "launch.py"), *QUIET, "fault.kind=hang", "fault.rank=-1", "fault.step=1",
            f"hydra.run.dir={job}"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (job / "steps.jsonl").exists() and (job / "steps.jsonl").read_text(), 120, "step 0")
    os.kill(wait_for(lambda: rank_pid(job.resolve(), 1), 30, "rank 1"), signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert results(job)["error"].startswith("rank 1: killed by SIGKILL")
    assert leftovers(tmp_path) == []


def test_sigint_mid_sweep_then_resume_runs_the_rest(tmp_path):
    """Ctrl-C while job 1 hangs; resume= re-runs jobs 1 and 2, job 1 from the checkpoint it took after step 0."""
    sweep = tmp_path / "multirun"
    args = [sys.executable, str(ROOT / "launch.py"), "-m", *FAST, "fault.rank=-1", "fault.step=1",
            "fault.kind=none,hang,none", "checkpoint.every=1", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "WANDB_MODE": "offline"})
    # Job 1 hangs (every rank) at step 1: once step 0 is recorded, it is mid-run, whatever the speed.
    wait_for(lambda: (sweep / "1" / "steps.jsonl").exists() and (sweep / "1" / "steps.jsonl").read_text(), 180,
             "job 1 to start")
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert leftovers(tmp_path) == []  # every rank stopped
    assert results(sweep / "0")["status"] == "ok"  # the finished job keeps its result
    interrupted = results(sweep / "1")
    assert interrupted["status"] == "interrupted" and [s["step"] for s in interrupted["steps"]] == [0]
    assert wandb_exit_code(sweep / "1") is not None  # rank 0 closed its W&B run
    assert not (sweep / "2").exists()  # the sweep stopped
    kept = (sweep / "0" / "results.json").read_bytes()

    # resume= re-runs jobs 1 and 2 only, into their own folders, with fault.kind=none (and no W&B,
    # for speed) on top of their own overrides.
    resumed = launch(f"resume={sweep}", "fault.kind=none", "logger=none", tmp_path=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert [results(sweep / str(i))["status"] for i in range(3)] == ["ok", "ok", "ok"]
    assert (sweep / "0" / "results.json").read_bytes() == kept
    assert results(sweep / "1" / "attempts" / "1")["status"] == "interrupted"  # the earlier attempt is kept
    rerun = results(sweep / "1")
    assert rerun["summary"]["resumed_from"]["step"] == 1 and [s["step"] for s in rerun["steps"]] == [1, 2, 3]
    assert results(sweep / "2")["summary"]["resumed_from"] is None  # it never started: from step 0
    assert "#0 :" not in resumed.stdout + resumed.stderr  # job 0 was not launched again
    again = launch(f"resume={sweep}", tmp_path=tmp_path)
    assert again.returncode == 0 and "nothing to resume" in again.stdout
