"""The memory accounting on tensors of known sizes (no process group): what a rank holds, and its
summary beside the ZeRO paper's figures (rank/memory.py)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ddp_lab.rank.memory import (
    host_peak_bytes,
    host_peak_from_now,
    memory_snapshot,
    model_state_bytes,
    summarize_memory,
)

MiB = 2**20


def _slices_optimizer():
    """A zero2-like rank: a 10x10 weight and a 10-bias whose flat storage is shared with two 1-D
    slices (30 + 5 elements) that the inner optimizer owns and whose gradients it holds."""
    flat = torch.zeros(110)
    model = nn.Linear(10, 10)
    with torch.no_grad():
        model.weight.data = flat[:100].view(10, 10)
        model.bias.data = flat[100:]
    slices = [nn.Parameter(flat[70:100]), nn.Parameter(flat[100:105])]
    for s in slices:
        s.grad = torch.ones_like(s)
    inner = torch.optim.AdamW(slices, lr=0.1)
    inner.step()
    return model, SimpleNamespace(optim=inner), slices


def test_a_sharded_optimizers_slices_hold_the_gradients():
    model, optimizer, _ = _slices_optimizer()
    # params: the full model (110 floats); grads: only the slices' 35 (the model's are None);
    # optimizer state: m and v of the 35 elements, plus one 4-byte step per slice.
    assert model_state_bytes(model, optimizer) == {"params": 440, "grads": 140, "optimizer_state": 280 + 8}


def test_a_gradient_held_by_model_and_optimizer_counts_once():
    model = nn.Linear(10, 10)
    optimizer = SimpleNamespace(optim=torch.optim.AdamW([model.weight], lr=0.1))  # zero1-like: owns the weight
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert model_state_bytes(model, optimizer)["grads"] == 440
    assert model_state_bytes(model)["grads"] == 440


def _strategy(module: nn.Module, kept=(), peak_gathered_bytes=None) -> nn.Module:
    """`module` with what the memory accounting reads of a strategy (strategies/base.py's contract)."""
    module.kept_tensors = lambda: list(kept)
    module.peak_gathered_bytes = peak_gathered_bytes
    return module


def test_snapshot_records_peak_gathered_when_the_wrapper_has_one():
    model = _strategy(nn.Linear(4, 4))
    assert "peak_gathered_bytes" not in memory_snapshot(model, None, torch.device("cpu"))
    model.peak_gathered_bytes = 1234
    snapshot = memory_snapshot(model, None, torch.device("cpu"))
    assert snapshot["peak_gathered_bytes"] == 1234 and snapshot["params"] == 80


def _rank(params, grads, state, **extra):
    point = {"params": params, "grads": grads, "optimizer_state": state, **extra}
    return {"after_init": {"params": params, "grads": 0, "optimizer_state": 0},
            "before_step": point, "after_step": dict(point)}


def test_summary_against_the_zero_paper():
    """Psi = 1 Mi parameters, fp32 AdamW, stage 2 at 4 ranks: the paper says (4 + 12/4) Psi = 7 MiB.
    Rank 1 holds 2% more (padding, say): it is the largest rank and sets the ratio."""
    psi = MiB
    exact = (4 * psi, psi, 2 * psi)
    ranks = [_rank(*exact), _rank(4 * psi, int(1.02 * psi), int(2.04 * psi), peak_gathered_bytes=99),
             _rank(*exact), _rank(*exact)]
    summary = summarize_memory(ranks, psi, 4, 2)
    assert summary["expected"] == {"params": 4 * psi, "grads": psi, "optimizer_state": 2 * psi}
    assert summary["expected_total"] == 7 * psi and summary["full_total"] == 16 * psi
    assert summary["zero_fraction"] == pytest.approx(7 / 16)
    assert summary["model_state_max_rank"] == 4 * psi + int(1.02 * psi) + int(2.04 * psi)
    assert summary["model_state_max_rank_parts"] == {"params": 4 * psi, "grads": int(1.02 * psi),
                                                      "optimizer_state": int(2.04 * psi)}
    assert summary["model_state_ratio"] == pytest.approx(1 + 0.06 / 7, abs=1e-6)
    assert [r["model_state_at"] for r in summary["per_rank"]] == ["before_step"] * 4
    assert summary["per_rank"][0]["model_state_ratio"] == pytest.approx(1.0)
    assert summary["peak_gathered_bytes_max_rank"] == 99
    assert "max_memory_allocated_max_rank" not in summary


def test_mixed_precision_expects_fp32_state_and_records_the_papers_2_2_12_beside_it():
    """Autocast here keeps fp32 parameters, gradients and moments: the expected figure is fp32's
    4 + 4 + 8 at every precision. The paper's mixed-precision figure (figure 1: 7.5B parameters at
    64 GPUs, stage 2: (2 + 14/64) Psi = 16.6 GB) is recorded beside it."""
    psi = 7_500_000_000
    ranks = [_rank(2 * psi, 0, 0)]
    summary = summarize_memory(ranks, psi, 64, 2, "bf16")
    assert summary["expected_total"] == summarize_memory(ranks, psi, 64, 2)["expected_total"]
    assert summary["expected_total"] == (4 + 12 / 64) * psi
    assert summary["dtype"] == "fp32" and summary["precision"] == "bf16"
    assert summary["paper_mixed_total"] / 1e9 == pytest.approx(16.6, abs=0.05)
    assert summarize_memory(ranks, psi, 64, 2, "fp16")["paper_mixed_total"] == summary["paper_mixed_total"]
    assert "paper_mixed" not in summarize_memory(ranks, psi, 64, 2)


def test_strategy_state_is_summed_with_model_state_where_their_sum_peaks():
    """A rank that keeps 3 MiB between steps (pooled buckets, say): at init it holds no gradients
    yet, so the total peaks where all of model state and the kept state are held."""
    psi = MiB
    rank = _rank(4 * psi, 4 * psi, 8 * psi)
    rank["after_init"]["strategy_state"] = 3 * psi
    rank["after_step"]["strategy_state"] = 3 * psi
    summary = summarize_memory([rank], psi, 1, 0)
    assert summary["per_rank"][0]["state_total"] == 19 * psi
    assert summary["per_rank"][0]["state_total_at"] == "after_step"
    assert summary["strategy_state_max_rank"] == 3 * psi and summary["state_total_max_rank"] == 19 * psi
    assert summary["model_state_max_rank"] == 16 * psi


def test_whole_copies_held_through_a_step_count_with_the_shards_before_the_reduction():
    """FSDP2 under a pipeline, Psi = 1 Mi parameters over 2 ranks (fp32 AdamW, stage 3): at rest a rank holds its
    shard's 4 + 4 + 8 bytes a parameter, 8 MiB before its step; through the step it holds the stage's whole
    parameters and whole gradients beside the shards (unsharded_bytes, 8 MiB) while the gradient shards are not yet
    written: 2 + 4 + 8 = 14 MiB at that peak, which is the rank's state_total. Without whole copies, unchanged."""
    psi = MiB
    rank = _rank(2 * psi, 2 * psi, 4 * psi)
    for point in ("before_step", "after_step"):
        rank[point]["unsharded_bytes"] = 8 * psi
    summary = summarize_memory([rank], psi, 2, 3)
    assert summary["per_rank"][0]["state_total"] == 14 * psi
    assert summary["per_rank"][0]["state_total_at"] == "before_reduction"
    assert summary["state_total_max_rank"] == 14 * psi and summary["unsharded_bytes_max_rank"] == 8 * psi
    assert summary["model_state_max_rank"] == 8 * psi  # the ZeRO paper's figure stays the shards'
    plain = summarize_memory([_rank(2 * psi, 2 * psi, 4 * psi)], psi, 2, 3)
    assert plain["per_rank"][0]["state_total"] == 8 * psi and "unsharded_bytes_max_rank" not in plain


def test_snapshot_records_what_a_strategy_holds_whole():
    model = _strategy(nn.Linear(4, 4))
    assert "unsharded_bytes" not in memory_snapshot(model, None, torch.device("cpu"))
    model.unsharded_bytes = 160
    assert memory_snapshot(model, None, torch.device("cpu"))["unsharded_bytes"] == 160


def test_strategy_state_counts_kept_storages_that_hold_no_model_state():
    """A wrapper that keeps a bucket its gradients are views of (nothing extra) and a pool buffer."""
    bucket, pool = torch.zeros(110), torch.zeros(50)
    model = _strategy(nn.Linear(10, 10), kept=[bucket, pool, pool[:10]])
    model.weight.grad, model.bias.grad = bucket[:100].view(10, 10), bucket[100:]
    snapshot = memory_snapshot(model, None, torch.device("cpu"))
    assert snapshot["grads"] == 440 and snapshot["strategy_state"] == 200


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's /proc: the peak resident memory")
def test_the_host_peak_starts_afresh_and_sees_what_came_and_went():
    """What checkpoint_extra_bytes reads: a peak of 64 MiB allocated and freed after the reset is seen; one
    before it is not."""
    block = torch.ones(2**25)  # 128 MiB, freed before the reset
    del block
    resident = host_peak_from_now()
    assert host_peak_bytes() - resident < 2**25
    block = torch.ones(2**24)  # 64 MiB, touched
    del block
    assert host_peak_bytes() - resident >= 2**26 - MiB  # less what the allocator gave back meanwhile


def test_the_census_passes_over_the_fake_tensors_compiling_leaves_alive():
    """train.compile: torch.compile's tracing keeps fake tensors alive; they hold no memory, and reading their address
    is deprecated (a warning, an error to come), so the census skips them."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    from ddp_lab.rank.memory import live_tensor_bytes

    before = live_tensor_bytes()
    with FakeTensorMode():
        fake = torch.empty(2**20)  # 4 MiB, were it real
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert live_tensor_bytes() - before < 2**20
    del fake
