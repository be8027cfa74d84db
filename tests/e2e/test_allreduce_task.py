"""task=allreduce: the config is checked up front (memory, op, sizes) and a real 2-rank job records
what nccl-tests would: latency with its spread, algbw, busbw, backend, device, ranks and bytes."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from ddp_lab.config import register_configs
from ddp_lab.launcher.config_checks import ConfigError, validate
from ddp_lab.tasks.allreduce import MIN_ITERS, planned_iters
from tests.helpers.launching import launch, results

CONF = Path(__file__).resolve().parents[2] / "conf"
register_configs()


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=["task=allreduce", "backend=gloo", *overrides])


def test_the_issue_sweep_validates_on_this_machine():
    """world_size=2,4,6 x task.size_mb=1..1000 must be accepted where it fits (13 GiB at 6 ranks)."""
    from ddp_lab.launcher import config_checks as v
    from ddp_lab.machine import host_available_bytes

    need = 6 * (v.GLOO_SCRATCH * 1000 * 2**20 + v.RANK_BASELINE_BYTES)
    if need > v.MEMORY_HEADROOM * host_available_bytes():
        pytest.skip(f"needs {need / 2**30:.1f} GiB within {v.MEMORY_HEADROOM:.0%} of free memory")
    for ws in (2, 4, 6):
        for mb in (1, 10, 100, 1000):
            validate(_compose(f"world_size={ws}", f"task.size_mb={mb}"))


@pytest.mark.parametrize("overrides, phrase", [
    (["task.size_mb=10000000"], "task.size_mb=10000000"),          # 10 TiB: world_size copies cannot fit
    (["task.size_mb=0"], "task.size_mb must be > 0"),
    (["task.iters=0"], "task.iters must be >= 1"),
    (["task.size_mb=0.00001", "world_size=6"], "less than one float32 per rank"),
    (["profile=true"], "profile=true"),
])
def test_bad_benchmark_configs_are_one_line_errors(overrides, phrase):
    with pytest.raises(ConfigError) as info:
        validate(_compose(*overrides))
    assert phrase in str(info.value) and "\n" not in str(info.value)


def test_memory_refusal_names_the_fix():
    with pytest.raises(ConfigError, match="use a smaller task.size_mb or fewer ranks per node"):
        validate(_compose("task.size_mb=10000000", "world_size=2"))


def test_iterations_are_capped_by_the_time_budget():
    assert planned_iters(20, probe_s=0.01, budget_s=120) == 20        # small messages: as asked
    assert planned_iters(20, probe_s=10.0, budget_s=120) == 12        # 1 GiB at 10 s a call: 12 fit
    assert planned_iters(20, probe_s=100.0, budget_s=120) == MIN_ITERS  # never fewer than 3
    assert planned_iters(2, probe_s=100.0, budget_s=120) == 2         # nor more than asked


@pytest.mark.slow
def test_real_benchmark_sweep_at_two_ranks(tmp_path):
    proc = launch("task=allreduce", "task.op=all_reduce,all_gather", "task.size_mb=1", "task.iters=4",
                  "task.warmup_iters=1", "task.barrier=false", "logger=none", tmp_path=tmp_path, multirun=True)
    assert proc.returncode == 0, proc.stderr
    runs = [results(tmp_path / "multirun" / str(i)) for i in range(2)]
    for run, op, factor in zip(runs, ("all_reduce", "all_gather"), (1.0, 0.5)):  # 2(n-1)/n and (n-1)/n at n=2
        assert run["status"] == "ok", run["error"]
        s = run["summary"]
        assert (s["op"], s["bytes"], s["world_size"], s["backend"], s["device"]) == (op, 2**20, 2, "gloo", "cpu")
        assert s["iters"] == 4 and len(run["steps"]) == 4
        assert {"p50", "std", "min", "max", "p90"} <= set(s["latency_ms"])
        assert s["latency_ms"]["min"] <= s["latency_ms"]["p50"] <= s["latency_ms"]["max"]
        assert s["algbw_GBps"] == pytest.approx(2**20 / (s["latency_ms"]["p50"] / 1e3) / 1e9)
        assert s["busbw_GBps"] == pytest.approx(s["algbw_GBps"] * factor)
        assert all(step["latency_ms"] > 0 and step["busbw_GBps"] > 0 for step in run["steps"])
        assert run["env"]["world_size"] == 2 and s["barrier"] is False  # timed back to back
    # The end-of-sweep table has a collective table with both ops, timed back to back.
    assert "busbw" in proc.stdout and "all_gather back-to-back" in proc.stdout
