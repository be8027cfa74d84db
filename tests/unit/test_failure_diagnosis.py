"""The one-line error of a failed job, from the evidence a real failure leaves (no ranks started).

The torchrun summary below is what torch 2.13's torchrun prints when a rank dies from a signal;
test_failures.py checks the same path end to end with a real SIGKILL.
"""

import json
import os
import signal
import time

from omegaconf import OmegaConf

from ddp_lab.launcher.failures import diagnose, signalled_ranks
from ddp_lab.launcher.resume import merge_overrides, own_checkpoint, set_aside_previous_attempt
from ddp_lab.rank.worker import describe_exception

SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
ddp_lab.rank.worker FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-21_19:45:59
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 22306)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-21_19:45:59
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 22307)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 22307
============================================================"""


def write_errors(job_dir, *rank_lines):
    """errors/rank{R}.txt in the given order, each with a later mtime than the one before."""
    (job_dir / "errors").mkdir(parents=True, exist_ok=True)
    for i, (rank, line) in enumerate(rank_lines):
        path = job_dir / "errors" / f"rank{rank}.txt"
        path.write_text(line + "\n")
        os.utime(path, ns=(time.time_ns() + i * 10**9,) * 2)


def test_earliest_error_is_the_cause_not_the_broken_collective(tmp_path):
    write_errors(tmp_path, (1, "InjectedFault: injected crash at step 1"),
                 (0, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:31629"))
    assert diagnose(tmp_path, 1, "", False, 300) == "rank 1: InjectedFault: injected crash at step 1"


def test_timeout_names_the_rank_that_never_joined(tmp_path):
    write_errors(tmp_path, (0, "RuntimeError: [gloo] Timed out waiting 10000ms for recv operation to complete"),
                 (1, "Terminated: stopped by SIGTERM while still running"))
    error = diagnose(tmp_path, 1, "", False, 10)
    assert error.startswith("rank 0: collective timed out after backend.timeout_s=10 s, rank 1 never joined it (hung)")


def test_sigkilled_rank_is_out_of_memory_when_the_kernel_says_so(tmp_path):
    write_errors(tmp_path, (0, "RuntimeError: [gloo] Connection reset by peer"))
    assert signalled_ranks(SUMMARY) == {1: 9}
    assert diagnose(tmp_path, 1, SUMMARY, True, 300) == \
        "rank 1: out of memory: killed by the kernel's OOM killer (SIGKILL)"
    # No OOM kill recorded: still the SIGKILLed rank (the other only lost its peer), not called OOM.
    error = diagnose(tmp_path, 1, SUMMARY, False, 300)
    assert error.startswith("rank 1: killed by SIGKILL") and "no OOM kill was recorded" in error


def test_a_crash_in_native_code_is_the_cause_not_torchruns_sigterm(tmp_path):
    """Seen for real: rank 1 aborted (SIGABRT), then torchrun stopped rank 0 with SIGTERM."""
    summary = SUMMARY.replace("exitcode  : 1 (pid: 22306)", "exitcode  : -15 (pid: 22306)").replace(
        "exitcode  : -9 (pid: 22307)", "exitcode  : -6 (pid: 22307)")
    assert signalled_ranks(summary) == {0: 15, 1: 6}
    assert diagnose(tmp_path, 1, summary, False, 300).startswith("rank 1: died from SIGABRT")


def test_allocation_failures_read_as_out_of_memory():
    assert describe_exception(MemoryError()) == "out of memory: MemoryError"
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 46732656640 bytes.")
    assert describe_exception(cpu).startswith("out of memory: RuntimeError: [enforce fail")
    assert describe_exception(ValueError("bad\nsecond line")) == "ValueError: bad"


def test_resume_overrides_replace_the_same_key():
    assert merge_overrides(["model=toy", "fault.kind=hang", "+x=1"], ["fault.kind=none", "x=2"]) == \
        ["model=toy", "fault.kind=none", "x=2"]


def test_a_rerun_sets_the_last_attempt_aside_per_node(tmp_path):
    """Node 1 moves only its own files: node 0's, in a shared folder, stay where they are."""
    for name in ("results.json", "steps.jsonl", "errors/rank0.txt", "errors/rank3.txt", "logs/rank3.log",
                 "logs/torchrun-node0.log", "logs/torchrun-node1.log", "node1.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    OmegaConf.save({"a": 1}, tmp_path / "config.yaml")
    set_aside_previous_attempt(tmp_path, node_rank=1, ranks=range(2, 4))
    moved = sorted(str(p.relative_to(tmp_path / "attempts" / "1")) for p in (tmp_path / "attempts" / "1").rglob("*")
                   if p.is_file())
    assert moved == ["errors/rank3.txt", "logs/rank3.log", "logs/torchrun-node1.log", "node1.json"]
    set_aside_previous_attempt(tmp_path, node_rank=0, ranks=range(0, 2))
    assert (tmp_path / "attempts" / "1" / "results.json").exists()  # same attempt number on every node
    assert (tmp_path / "config.yaml").exists() and not (tmp_path / "results.json").exists()
    set_aside_previous_attempt(tmp_path, node_rank=0, ranks=range(0, 2))  # nothing left: no attempt 2
    assert not (tmp_path / "attempts" / "2").exists()


def test_a_rerun_goes_on_from_its_own_newest_checkpoint_while_steps_are_left(tmp_path):
    """resume=: checkpoint.load= the job's own folder where it left a complete checkpoint with measured steps
    after it (train.steps - step > warmup_steps), replacing any checkpoint.load it started from."""
    job = tmp_path / "3"
    job.mkdir()
    assert own_checkpoint(job) == []  # no config.yaml: the job never started
    OmegaConf.save({"train": {"steps": 10, "warmup_steps": 1}}, job / "config.yaml")
    assert own_checkpoint(job) == []  # no checkpoint
    for step, complete in ((4, True), (8, True), (9, False)):
        folder = job / "checkpoints" / (f"step_{step}" if complete else f"step_{step}.partial")
        folder.mkdir(parents=True)
        (folder / ".metadata").write_bytes(b"")
        if complete:
            (folder / "checkpoint.json").write_text(json.dumps({"format": 1, "step": step}))
    # the newest complete one, step 8 (9 was never completed): 2 steps left, 1 of them warm-up
    assert merge_overrides(["model=toy", "checkpoint.load=/elsewhere"], own_checkpoint(job)) == \
        ["model=toy", f"checkpoint.load={job}"]
    OmegaConf.save({"train": {"steps": 10, "warmup_steps": 2}}, job / "config.yaml")
    assert own_checkpoint(job) == []  # no measured step would be left: from step 0


def _abort_in_a_named_place(job_dir):
    import resource

    from ddp_lab.rank.worker import dump_stacks_on_a_fatal_signal

    dump_stacks_on_a_fatal_signal(job_dir, 1)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file left behind
    os.abort()  # what glibc does on a corrupted heap ("malloc(): unaligned tcache chunk detected")


def test_a_rank_that_dies_of_a_native_abort_leaves_its_python_stack_in_its_log(tmp_path):
    import multiprocessing

    from ddp_lab import jobdir

    child = multiprocessing.get_context("fork").Process(target=_abort_in_a_named_place, args=(tmp_path,))
    child.start()
    child.join(timeout=30)
    assert child.exitcode == -signal.SIGABRT
    log = (tmp_path / jobdir.rank_log(1)).read_text()
    assert "Fatal Python error: Aborted" in log and "_abort_in_a_named_place" in log
