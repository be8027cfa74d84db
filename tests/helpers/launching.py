"""Run launch.py as a user would, with its output folders inside a test's tmp_path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAST = ["model=toy", "train.steps=4", "train.warmup_steps=1", "train.batch_size=4"]
EXAMPLES = f"hydra.searchpath=[file://{ROOT / 'examples' / 'conf'}]"  # the user's own config folder: examples/
NARROW = ["model.d_model=64", "model.d_ff=256", "model.num_layers=2", "model.num_heads=4"]  # model=tiny at 1/50


def launch(*overrides: str, tmp_path: Path, multirun: bool = False, timeout: float = 240,
           env: dict | None = None) -> subprocess.CompletedProcess:
    out = tmp_path / ("multirun" if multirun else "run")
    args = [sys.executable, str(ROOT / "launch.py"), *overrides,
            f"hydra.sweep.dir={out}" if multirun else f"hydra.run.dir={out}"]
    if multirun:
        args.append("-m")
    full_env = {**os.environ, "WANDB_MODE": "offline", **(env or {})}
    return subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=timeout, env=full_env)


def start(*overrides: str, cwd: Path, multirun: bool = False) -> subprocess.Popen:
    """launch.py in the background, with its output folders where Hydra puts them by default (under `cwd`)."""
    args = [sys.executable, str(ROOT / "launch.py"), *overrides] + (["-m"] if multirun else [])
    return subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def strategy_sweep(tmp_path: Path, strategies: list[str], *overrides: str) -> dict[str, Path]:
    """One FAST sweep over `strategies` with the final weights saved: {strategy: its job folder}."""
    proc = launch(*FAST, "logger=none", "train.save_model=true", f"strategy={','.join(strategies)}", *overrides,
                  tmp_path=tmp_path, multirun=True)
    assert proc.returncode == 0, proc.stderr
    return {name: tmp_path / "multirun" / str(i) for i, name in enumerate(strategies)}


def assert_same_saved_weights(job: Path, reference: Path) -> None:
    """The model.pt of two jobs (train.save_model=true): same names, whole shapes, equal to float32 rounding."""
    import torch

    weights, expected = torch.load(job / "model.pt"), torch.load(reference / "model.pt")
    assert set(weights) == set(expected)
    for key, tensor in expected.items():
        assert weights[key].shape == tensor.shape, key  # whole, not a shard
        torch.testing.assert_close(weights[key], tensor, atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


def results(job_dir: Path) -> dict:
    return json.loads((job_dir / "results.json").read_text())
