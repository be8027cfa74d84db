"""The CUDA paths, run where a GPU is visible and skipped otherwise: NCCL, the collectives' CUDA events, the
allocator's peak in the memory census, autocast and the fp16 scaler on the GPU.

One rank per job: NCCL refuses two ranks on one GPU, so on a one-GPU machine these prove that every
strategy's GPU path runs, records its figures and trains to the same weights as the flat strategy on the
same GPU. The multi-rank parity proofs are the gloo suites'.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.launching import FAST, assert_same_saved_weights, launch, results, strategy_sweep

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")]

# Every strategy but DeepSpeed's (an optional extra; its own suite runs where it is installed).
STRATEGIES = ["flat", "naive", "overlap", "bucketed", "zero1", "zero2", "fsdp", "hsdp", "powersgd",
              "local_sgd", "torch_ddp", "replicate_torch", "zero1_torch", "fsdp_torch"]
ONE_GPU = ["world_size=1", "backend=auto"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict:
    return strategy_sweep(tmp_path_factory.mktemp("cuda"), STRATEGIES, *ONE_GPU)


def test_every_strategy_runs_on_nccl_with_its_figures(sweep):
    for name, job in sweep.items():
        record = results(job)
        assert record["status"] == "ok", (name, record["error"])
        assert record["env"]["backend"] == "nccl", name
        assert record["env"]["collectives"] == "native", name
        summary = record["summary"]
        assert summary["step_time_ms"]["p50"] > 0, name
        assert summary["comm_ms"]["p50"] >= 0 and math.isfinite(summary["comm_ms"]["p50"]), name
        assert math.isfinite(summary["final_loss"]), name
        snapshot = summary["memory"]["per_rank"][0]["after_step"]
        assert snapshot.get("max_memory_allocated", 0) > 0, (name, snapshot)


def test_every_strategy_trains_to_flats_weights_on_the_gpu(sweep):
    failed = []
    for name, job in sweep.items():
        try:
            assert_same_saved_weights(job, sweep["flat"])
        except AssertionError as error:
            failed.append(f"{name}: {error}")
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_on_the_gpu(tmp_path, precision):
    """Autocast on CUDA, and for fp16 the scaler's unscale and inf check on CUDA tensors."""
    proc = launch(*FAST, *ONE_GPU, "logger=none", "strategy=flat,zero2,fsdp", f"train.precision={precision}",
                  tmp_path=tmp_path, multirun=True)
    assert proc.returncode == 0, proc.stderr
    for i in range(3):
        record = results(tmp_path / "multirun" / str(i))
        assert record["status"] == "ok", record["error"]
        assert math.isfinite(record["summary"]["final_loss"])


def test_allreduce_benchmark_on_nccl(tmp_path):
    proc = launch(*ONE_GPU, "task=allreduce", "task.size_mb=16", "logger=none", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    record = results(tmp_path / "run")
    assert record["status"] == "ok", record["error"]
    assert record["env"]["backend"] == "nccl"
    assert "cpu" not in record["env"]["devices"][0]


def test_a_checkpoint_moves_between_strategies_on_the_gpu(tmp_path):
    """DCP's save from CUDA tensors and its load into them: fsdp's checkpoint after 4 steps, taken by
    bucketed for 4 more, ends where fsdp's own 8 steps end (to float32 rounding)."""
    run = [*FAST, *ONE_GPU, "logger=none", "train.steps=8", "train.save_model=true"]
    for side in ("fsdp", "bucketed"):
        (tmp_path / side).mkdir()
    first = launch(*run, "strategy=fsdp", "checkpoint.every=4", tmp_path=tmp_path / "fsdp")
    assert first.returncode == 0, first.stderr
    moved = launch(*run, "strategy=bucketed", f"checkpoint.load={tmp_path / 'fsdp' / 'run' / 'checkpoints' / 'step_4'}",
                   tmp_path=tmp_path / "bucketed")
    assert moved.returncode == 0, moved.stderr
    assert results(tmp_path / "bucketed" / "run")["summary"]["resumed_from"]["step"] == 4
    assert_same_saved_weights(tmp_path / "bucketed" / "run", tmp_path / "fsdp" / "run")


@pytest.mark.parametrize("strategy", [["strategy=powersgd", "strategy.start_iter=0"],
                                      ["strategy=local_sgd", "strategy.sync_every=3", "strategy.outer=nesterov"]],
                         ids=["powersgd", "local_sgd"])
def test_a_strategys_own_state_continues_on_the_gpu(tmp_path, strategy):
    """Per-rank state saved from CUDA tensors and given back into them (powersgd's error feedback and Q, local
    SGD's own parameters and DiLoCo's outer state): 4 steps, a checkpoint, 4 more end where 8 straight do."""
    run = [*FAST, *ONE_GPU, "logger=none", "train.steps=8", "train.save_model=true", *strategy]
    for side in ("straight", "resumed"):
        (tmp_path / side).mkdir()
    straight = launch(*run, "checkpoint.every=4", tmp_path=tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr
    resumed = launch(*run, f"checkpoint.load={tmp_path / 'straight' / 'run' / 'checkpoints' / 'step_4'}",
                     tmp_path=tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr
    assert results(tmp_path / "resumed" / "run")["summary"]["resumed_from"]["rank_state"] is True
    assert_same_saved_weights(tmp_path / "resumed" / "run", tmp_path / "straight" / "run")
