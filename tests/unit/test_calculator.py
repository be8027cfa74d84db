"""The calculator's counts match the built models and hand counts, and its accounting matches hand-computed
examples, strategy by strategy from their specs."""

import json

import pytest
import torch

from ddp_lab.analysis import calculator as calc
from ddp_lab.arithmetic.zero_bytes import model_state_bytes
from ddp_lab.models import build_model
from ddp_lab.models.facts import parameter_counts

SIZES = ["toy", "tiny", "small", "medium", "large", "xl", "2.7b"]


@pytest.mark.parametrize("name", SIZES)
def test_parameter_count_matches_built_model(name):
    cfg = calc.load_model_config(name)
    # The meta device builds the very same modules without allocating or initializing storage.
    with torch.device("meta"):
        model = build_model(cfg)
    assert parameter_counts(cfg)["total"] == sum(p.numel() for p in model.parameters())


def test_toy_count_on_a_real_model():
    cfg = calc.load_model_config("toy")
    assert parameter_counts(cfg)["total"] == sum(p.numel() for p in build_model(cfg).parameters())


@pytest.mark.parametrize("name", ["toy", "tiny"])
def test_activations_of_a_small_model_count_as_the_meta_device_does(name):
    """Counted on a real CPU forward of one sequence times the batch: within 6% of the meta device's count at
    the batch (the CPU's attention kernel saves less than the meta decomposition), never more than 1% over."""
    from ddp_lab.models.facts import _activation_bytes, _key, activation_bytes

    cfg = calc.load_model_config(name)
    meta = _activation_bytes(_key(cfg), 8, "meta")
    assert 0.94 * meta <= activation_bytes(cfg, 8) <= 1.01 * meta


def test_launch_py_checks_a_model_without_importing_dynamo():
    """Building the model on the meta device and counting its activations imports no torch._dynamo (2 s of
    every launch.py on 2 cores): torch.nn.init's fills skipped, RoPE's tables computed on the CPU."""
    import subprocess
    import sys

    code = ("import sys; from ddp_lab.analysis.calculator import load_model_config; "
            "from ddp_lab.launcher.memory_estimate import estimate_rank_bytes; from omegaconf import OmegaConf; "
            "from ddp_lab.models.facts import meta_model; "
            "cfg = OmegaConf.create({'model': load_model_config('tiny'), 'world_size': 2, "
            "'train': {'batch_size': 8, 'grad_accum_steps': 1}}); meta_model(load_model_config('xl')); "
            "assert estimate_rank_bytes(cfg, 1) > 0; assert 'torch._dynamo' not in sys.modules, 'imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_small_by_hand():
    # small: V=10000, d=768, d_ff=3072, L=12, context 128.
    # embedding = lm_head = 10000*768 = 7,680,000
    # per block: 4*768^2 = 2,359,296 (qkv + proj) + 3*768*3072 = 7,077,888 (SwiGLU) + 2*768 (norms)
    #          = 9,438,720; x12 = 113,264,640; + final norm 768
    # total = 15,360,000 + 113,264,640 + 768 = 128,625,408
    cfg = calc.load_model_config("small")
    psi = 128_625_408
    assert parameter_counts(cfg)["total"] == psi
    assert parameter_counts(cfg)["lookup"] == 7_680_000 and parameter_counts(cfg)["other"] == 25 * 768

    r = calc.calculate(cfg, world_size=8, dtype="bf16", flops=989e12, bandwidth=450e9)
    ddp, z1_cs336, z2, z3 = (r["strategies"][k] for k in ("bucketed", "zero1", "zero2", "fsdp"))
    z1 = calc.calculate(cfg, world_size=8, dtype="bf16", flops=989e12, bandwidth=450e9, strategies=["zero1"],
                        knobs={"comm": "reduce_scatter"})["strategies"]["zero1"]  # ZeRO-1 as the paper has it
    # Mixed-precision Adam: 2 + 2 + 12 = 16 bytes/param unsharded = 2,058,006,528 bytes.
    assert ddp["memory"]["total"] == 16 * psi == 2_058_006_528
    # ZeRO-1 over 8: 2 + 2 + 12/8 = 5.5 bytes/param = 707,439,744; ZeRO-2: 2 + 14/8; ZeRO-3: 16/8.
    assert z1["memory"]["total"] == pytest.approx(707_439_744)
    assert z2["memory"]["total"] == pytest.approx(3.75 * psi)
    assert z3["memory"]["total"] == pytest.approx(2 * psi)
    # All-reduce of bf16 grads at N=8: 2*7/8 * 2 bytes * psi = 3.5 * psi = 450,188,928 bytes,
    # i.e. 1.0004 ms at 450 GB/s. ZeRO-1 (reduce-scatter + all-gather) moves the same.
    assert ddp["comm_bytes"] == pytest.approx(450_188_928)
    assert z1["comm_bytes"] == pytest.approx(ddp["comm_bytes"])
    assert z1_cs336["comm_bytes"] == pytest.approx(3.5 * psi + 2 * psi)  # all-reduce, then owners broadcast
    assert z3["comm_bytes"] == pytest.approx(1.5 * ddp["comm_bytes"])
    # FLOPs per token forward: 2 * matmul weights + 4*L*ctx*d.
    # matmul weights = psi - embedding 7,680,000 - norms 25*768 = 120,926,208
    # forward = 241,852,416 + 4*12*128*768 (4,718,592) = 246,571,008; backward = 493,142,016.
    assert r["flops_per_token"]["forward"] == 246_571_008
    # Compute-bound batch (backward vs all-reduce): 1.0004198e-3 s * 989e12 / 493,142,016 FLOP/token
    # = 2006.4 tokens = 15.675 sequences of 128 per device.
    assert ddp["compute_bound_batch"] == pytest.approx(450_188_928 / 450e9 * 989e12 / 493_142_016 / 128)
    assert ddp["compute_bound_batch"] == pytest.approx(15.675, abs=1e-3)


def test_zero_paper_example():
    # ZeRO paper figure 1: 7.5B params, N=64, K=12: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB.
    expected = {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.875e9}
    for stage, total in expected.items():
        got = model_state_bytes(7.5e9, "bf16", 64, stage)["total"]
        assert got == pytest.approx(total, rel=0.005)
    assert model_state_bytes(10, "fp32")["total"] == 160   # 4 + 4 + 8 bytes per param


def test_cli(capsys):
    assert calc.main(["model=tiny", "world_size=4", "dtype=fp32", "model.context_length=32"]) == 0
    out = capsys.readouterr().out
    assert "9,316,608 parameters" in out and "fsdp" in out and "context 32" in out
    assert calc.main(["--model", "toy", "--world-size", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["params"]["total"] == 194_176 and report["world_size"] == 2
    with pytest.raises(SystemExit):
        calc.main(["model=nope"])


def test_the_context_report_is_the_hand_worked_example():
    """tiny (d_model 256, 4 layers, 8 heads) at cp 4, one sequence of 1024 tokens, fp32: a rank holds 256 tokens; the
    ring sends K and V 3 times forward, 2 x 3 x 256 x 256 x 4 bytes = 1.5 MiB a layer (6 MiB for 4), twice that
    backward (K, V again and their gradients); Ulysses 3/4 of q, k, v and out, 0.75 MiB a layer each way; the
    contiguous ring's last rank scores 3 full blocks of 256 x 256 and a diagonal of 256 x 257 / 2 against a mean of
    1.5 and one: 229504 / 131200."""
    from ddp_lab.analysis.context_accounting import context_accounting

    r = context_accounting(calc.load_model_config("tiny", {"context_length": 1024}), 4, 4, 1, "fp32", 1e11, 1e9, 1.0)
    rows = {row["impl"]: row for row in r["impls"]}
    assert r["tokens_per_rank"] == 256
    assert (rows["ring"]["bytes_forward"], rows["ring"]["bytes_backward"]) == (6 * 2**20, 12 * 2**20)
    assert (rows["ulysses"]["bytes_forward"], rows["ulysses"]["bytes_backward"]) == (3 * 2**20, 3 * 2**20)
    assert rows["ring"]["imbalance"] == pytest.approx(229504 / 131200)
    assert rows["zigzag"]["imbalance"] == 1.0
    assert rows["ring"]["exposed_s"] == 0.0  # 18.9 ms of exchange under the busiest rank's 28.2 ms of attention
    for row in rows.values():
        assert row["longest_context"] % (8 if row["impl"] in ("zigzag", "torch") else 4) == 0
        assert row["longest_context"] * r["activation_bytes_per_token"] / 4 + r["model_state_bytes"] <= 1e9


def test_the_context_report_refuses_what_cannot_run():
    from ddp_lab.analysis.context_accounting import context_accounting

    r = context_accounting(calc.load_model_config("tiny", {"context_length": 1020}), 4, 4, 1)
    rows = {row["impl"]: row for row in r["impls"]}
    assert "does not divide by 8" in rows["zigzag"]["problem"] and "problem" not in rows["ring"]
    with pytest.raises(ValueError, match="divide --world-size"):
        context_accounting(calc.load_model_config("tiny"), 4, 3, 1)
