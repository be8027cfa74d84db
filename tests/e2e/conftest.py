"""Sweeps that several e2e files read. A launch.py job costs about 10 s on 2 cores whatever it trains (torchrun
and every rank import torch), so a job whose folder proves facts for several files runs once per session."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.launching import EXAMPLES, FAST, launch, results, start, strategy_sweep

LADDER = ["bucketed", "zero1", "zero1_torch", "zero2", "fsdp", "fsdp_torch"]


@pytest.fixture(scope="session")
def ladder(tmp_path_factory) -> dict[str, Path]:
    """bucketed and the strategies that shard, on the toy model with the final weights saved (logger=none),
    a checkpoint after steps 2 and 4, the first written while steps 2 and 3 run (checkpoint.async_save):
    {strategy: its job folder}. test_zero1_launch, test_zero2_launch and test_fsdp_launch read it,
    test_checkpoint_launch its checkpoints."""
    return strategy_sweep(tmp_path_factory.mktemp("ladder"), LADDER, "checkpoint.every=2", "checkpoint.async_save=true")


@pytest.fixture(scope="session")
def hsdp_at_four_ranks(tmp_path_factory) -> Path:
    """One hsdp job at 4 ranks with shard_size=2 (2 shard groups of 2) and logger=none: its job folder.
    test_fsdp_launch reads the sharding and that no W&B run was written."""
    tmp = tmp_path_factory.mktemp("hsdp")
    proc = launch(*FAST, "train.batch_size=8", "world_size=4", "strategy=hsdp", "strategy.shard_size=2",
                  "logger=none", tmp_path=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "run"


@pytest.fixture(scope="session")
def crash_sweep(tmp_path_factory) -> tuple:
    """zero2 at 2 bucket sizes x (rank 1 a 3x straggler from step 2, rank 1 crashes at step 2), profiled:
    (launch.py's process, the sweep folder, {job number: results.json}). Jobs 0 and 2 end ok, 1 and 3 failed
    (Hydra's order: the first override varies slowest). test_failures reads the crash, the sweep going on
    and the straggler's record, test_report_launch the table, the traces and the report."""
    tmp = tmp_path_factory.mktemp("crash_sweep")
    proc = launch(*FAST, "strategy=zero2", "strategy.bucket_mb=0.05,1", "fault.kind=slow,crash", "fault.rank=1",
                  "fault.step=2", "fault.slowdown=3", "profile=true", "logger=none", tmp_path=tmp, multirun=True)
    sweep = tmp / "multirun"
    return proc, sweep, {i: results(sweep / str(i)) for i in range(4)}


EXAMPLE_SWEEP = ["bucketed_after_backward", "bucketed", "fsdp"]


@pytest.fixture(scope="session")
def examples_sweep(tmp_path_factory) -> dict[str, Path]:
    """The example strategy from outside the package beside bucketed and fsdp, on the example model (tied
    embedding and head), from the user's config folder (hydra.searchpath), final weights saved: {strategy: its
    job folder}. test_examples reads the weights, test_predict_launch replays the jobs."""
    return strategy_sweep(tmp_path_factory.mktemp("examples"), EXAMPLE_SWEEP, EXAMPLES, "model=tied_gpt")


@pytest.fixture(scope="session")
def sweeps_started_together(tmp_path_factory) -> dict[str, SimpleNamespace]:
    """Two sweeps started at the same moment from one folder, with the default output folders (TIME_PID) and
    W&B on (offline): `strategy=naive,flat` and `strategy=naive`. {strategies: (returncode, stdout, stderr,
    sweep folder, that folder relative to where they started)}. test_launch reads the 2-job sweep's W&B
    folder and view, test_scale that they did not collide."""
    tmp = tmp_path_factory.mktemp("together")
    procs = {name: start(*FAST, f"strategy={name}", cwd=tmp, multirun=True) for name in ("naive,flat", "naive")}
    ended = {name: (proc, *proc.communicate(timeout=300)) for name, proc in procs.items()}
    sweeps = {s.name.rsplit("_", 1)[-1]: s for s in (tmp / "outputs" / "multirun").glob("*/*")}  # TIME_PID
    found = {name: sweeps.get(str(proc.pid)) for name, (proc, _, _) in ended.items()}
    return {name: SimpleNamespace(returncode=proc.returncode, stdout=out, stderr=err, sweep=found[name],
                                  relative=found[name] and found[name].relative_to(tmp))
            for name, (proc, out, err) in ended.items()}
