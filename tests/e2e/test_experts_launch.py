"""Expert parallelism through launch.py: `model=tiny_moe world_size=2 parallel.ep=1,2 -m`, as a user sweeps it.

Both jobs train the same mixture on the same global batches, one with every expert on every rank, one with half of
them on each: the same loss at every step and the same weights (the experts gathered whole into model.pt). The ep
job's steps carry the all-to-all's bytes in four parts that pair up (what a rank dispatched forward it receives
back as gradients), its summary the experts it held; both carry the experts' load, and the sweep's table shows it.
That every layout trains to one process's weights is tests/parity/test_experts.py's.
"""

from __future__ import annotations

import pytest

from ddp_lab.spec.figures import EP_BYTES, EP_PARTS, LOSS, MOE_BUSIEST
from tests.helpers.launching import launch, results

pytestmark = pytest.mark.slow
SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.expert_d_ff=32", "model.experts=4",
         "model.context_length=16"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("experts")
    proc = launch("model=tiny_moe", *SMALL, "train.steps=4", "train.warmup_steps=1", "logger=none", "world_size=2",
                  "strategy=bucketed", "train.save_model=true", "parallel.ep=1,2", tmp_path=tmp_path, multirun=True)
    assert proc.returncode == 0, proc.stderr
    return results(tmp_path / "multirun" / "0"), results(tmp_path / "multirun" / "1"), tmp_path / "multirun", proc


def test_splitting_the_experts_trains_as_keeping_them_whole(sweep):
    import torch

    whole, split, folder, _ = sweep
    for a, b in zip(whole["steps"], split["steps"]):
        assert b[LOSS.key] == pytest.approx(a[LOSS.key], rel=1e-5)
    kept, gathered = torch.load(folder / "0" / "model.pt"), torch.load(folder / "1" / "model.pt")
    assert set(kept) == set(gathered)
    for name, tensor in kept.items():
        torch.testing.assert_close(gathered[name], tensor, atol=1e-5, rtol=1e-4, msg=name)


def test_the_exchange_and_the_load_are_measured(sweep):
    whole, split, _, proc = sweep
    assert split["summary"]["mesh"]["label"] == "2x1-ep2"
    experts = split["summary"]["mesh"]["experts"]
    assert experts["experts_per_rank"] == 2
    assert experts["expert_param_bytes"] * 2 == whole["summary"]["mesh"]["experts"]["expert_param_bytes"]
    tokens, top_k, width = 4 * 16, 2, 32  # a rank's rows of the batch of 8, top-2, d_model
    for step in split["steps"]:
        dispatch_forward, dispatch_backward, combine_forward, combine_backward = (step[p.key] for p in EP_PARTS)
        assert dispatch_forward == combine_backward and combine_forward == dispatch_backward
        assert 0 < step[EP_BYTES.key] <= 2 * 4 * tokens * top_k * width * 4  # two layers, never more than every row
        assert 1 / 4 <= step[MOE_BUSIEST.key] <= 1
    assert EP_BYTES.key not in whole["steps"][-1] and MOE_BUSIEST.key in whole["steps"][-1]
    rows = experts["rows_per_rank"]  # every routed slot of every training step, 4 steps x 2 layers, dropless
    assert sum(rows) == 4 * 2 * (8 * 16) * top_k and experts["busiest_rank"] == rows.index(max(rows))
    assert "busiest expert" in proc.stdout and "ep MiB/step" in proc.stdout
