"""Context parallelism through launch.py: `world_size=2 parallel.cp=1,2 parallel.cp_impl=zigzag -m`.

Both jobs train the same global batch, one split by rows (dp=2), one by tokens (cp=2): the same weights, and the
same loss logged at every step (the mean over every token of the batch, not a cp-th of it nor cp times it: the
reports users file against other frameworks). The cp job's steps carry the bytes spec/context.py's formula gives
and its summary the per-rank work, the imbalance and the ring's hidden share. That every implementation and mesh
trains to one process's weights is tests/parity/test_context_parallel.py's.
"""

from __future__ import annotations

import pytest

from ddp_lab.spec.context import exchange_bytes, work_pairs
from ddp_lab.spec.figures import CP_BYTES_BACKWARD, CP_BYTES_FORWARD, LOSS
from tests.helpers.launching import NARROW, launch, results

pytestmark = pytest.mark.slow
CONTEXT, BATCH, LAYERS, HEADS, WIDTH = 64, 4, 2, 4, 64


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("context")
    proc = launch("model=tiny", *NARROW, f"model.context_length={CONTEXT}", "train.steps=4", "train.warmup_steps=1",
                  f"train.batch_size={BATCH}", "logger=none", "world_size=2", "strategy=flat", "train.save_model=true",
                  "parallel.cp=1,2", "parallel.cp_impl=zigzag", tmp_path=tmp_path, multirun=True)
    assert proc.returncode == 0, proc.stderr
    return results(tmp_path / "multirun" / "0"), results(tmp_path / "multirun" / "1"), tmp_path / "multirun"


def test_splitting_tokens_trains_as_splitting_rows(sweep):
    """The loss of every step to 1e-5, and the weights to float32 rounding but for the odd element AdamW amplifies:
    a weight whose gradient is near 0 moves by about lr x its gradient over its running root mean square, so the
    rounding of a tiny gradient, which any other order of summation changes, becomes a whole step (seen: 1 element of
    the 16384 of blocks.0.ffn.w1 apart by 3.2e-4; the parity proofs hold both to rounding under SGD)."""
    import torch

    rows, tokens, folder = sweep
    for a, b in zip(rows["steps"], tokens["steps"]):
        assert b[LOSS.key] == pytest.approx(a[LOSS.key], rel=1e-5)
    split, whole = torch.load(folder / "1" / "model.pt"), torch.load(folder / "0" / "model.pt")
    assert set(split) == set(whole)
    for name, tensor in whole.items():
        apart = ((split[name] - tensor).abs() > 1e-5 + 1e-4 * tensor.abs()).sum().item()
        assert apart <= max(1, tensor.numel() // 10_000), (name, apart)


def test_the_exchange_and_the_work_are_measured(sweep):
    _, tokens, _ = sweep
    assert tokens["summary"]["mesh"]["label"] == "1x1-cp2"
    want = exchange_bytes("zigzag", 2, 2, BATCH * CONTEXT // 2, WIDTH, WIDTH, 4)
    for step in tokens["steps"]:
        assert step[CP_BYTES_FORWARD.key] == LAYERS * want["forward"]
        assert step[CP_BYTES_BACKWARD.key] == LAYERS * want["backward"]
    context = tokens["summary"]["mesh"]["context"]
    pairs = [rank["pairs"] for rank in context["per_rank"]]
    assert pairs == [LAYERS * work_pairs(r, 2, "zigzag", 2, CONTEXT, HEADS) for r in range(2)]
    assert context["imbalance_counted"] == context["imbalance_formula"] == 1.0
    assert context["exchange_alone_ms"] > 0 and 0 <= context["hidden_pct"] <= 100
