"""Beyond one launch.py: two nodes through torchrun's rendezvous, SLURM's code path through
submitit's local executor, and two sweeps started at the same moment on one machine."""

import socket

import pytest
from omegaconf import OmegaConf

from tests.helpers.launching import FAST, results, start
from tests.helpers.processes import leftovers
from tests.helpers.wandb_records import read_run, run_file_of_job

pytestmark = pytest.mark.slow
QUIET = [*FAST, "logger=none"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_rendezvous_into_one_job(tmp_path):
    """Two launch.py, node_rank 1 started first: still one 4-rank job with rank 0 on node_rank 0."""
    node = [f"launcher.rdzv_endpoint=127.0.0.1:{free_port()}", "launcher.nnodes=2", "world_size=4", *QUIET]
    second = start(*node, "launcher.node_rank=1", f"hydra.run.dir={tmp_path / 'node1'}", cwd=tmp_path)
    first = start(*node, "launcher.node_rank=0", f"hydra.run.dir={tmp_path / 'node0'}", cwd=tmp_path)
    for proc in (first, second):
        proc.communicate(timeout=240)
        assert proc.returncode == 0
    res = results(tmp_path / "node0")
    assert res["status"] == "ok" and res["env"]["world_size"] == 4 and len(res["env"]["devices"]) == 4
    # node_rank 1 ran global ranks 2 and 3, and records its own status; results.json is node 0's.
    assert sorted(p.name for p in (tmp_path / "node1" / "logs").glob("rank*.log")) == ["rank2.log", "rank3.log"]
    node1 = OmegaConf.load(tmp_path / "node1" / "node1.json")
    assert node1.status == "ok" and node1.node_rank == 1
    assert not (tmp_path / "node1" / "results.json").exists()


def test_submitit_local_runs_a_sweep_point_as_a_two_node_job(tmp_path):
    """hydra/launcher=slurm_local: SLURM's code path (one task per node, node rank and endpoint
    from the scheduler's environment) with submitit's local executor."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    proc = start("hydra/launcher=slurm_local", "launcher.nnodes=2", "world_size=2", "strategy=naive", *QUIET,
                 cwd=tmp_path, multirun=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    (sweep,) = (tmp_path / "outputs" / "multirun").glob("*/*")  # the default folder, resolved once
    for num, strategy in enumerate(["naive"]):
        job = sweep / str(num)
        res = results(job)
        assert res["status"] == "ok" and res["env"]["world_size"] == 2
        assert res["config"]["strategy"]["name"] == strategy
        # Both tasks (nodes) of the job found the same folder: the ${ddp_lab.pid:} in the sweep dir
        # resolved in the job processes to the launching process's value, not their own.
        assert OmegaConf.load(job / "node1.json").status == "ok"
        assert OmegaConf.load(job / ".hydra" / "hydra.yaml").hydra.runtime.output_dir == str(job)
    assert "naive" in out
    assert leftovers(tmp_path) == []


def test_two_sweeps_started_together_do_not_collide(sweeps_started_together):
    """Default output folders (TIME_PID), free ports, random W&B run ids: both sweeps (2 jobs and 1) succeed
    (the session's pair, tests/e2e/conftest.py)."""
    for proc in sweeps_started_together.values():
        assert proc.returncode == 0, proc.stderr
    sweeps = [proc.sweep for proc in sweeps_started_together.values()]
    assert None not in sweeps and len(set(sweeps)) == 2
    jobs = [job for sweep in sweeps for job in sorted(sweep.glob("[0-9]"))]
    assert len(jobs) == 3 and all(results(job)["status"] == "ok" for job in jobs)
    run_ids = {read_run(run_file_of_job(job))["run"].run_id for job in jobs}
    assert len(run_ids) == 3
