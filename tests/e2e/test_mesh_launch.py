"""A mesh through launch.py: `world_size=4 parallel.tp=1,2 strategy=zero2 -m` with the lab's TP, and tp=2 with
torch's (at tp=1 the implementation changes nothing: no job of its own).

Every job trains to the same weights (train.save_model writes them whole, in the single-process layout), the
summary and the tables say each job's mesh, the TP axis's collectives per step are spec/parallel.py's schedule
(the lab's measured every step, torch's counted in step 0), and a rank holds about half the parameters at tp=2.
That every strategy and both implementations train to one process's weights is tests/parity/test_tensor_parallel.py's.
"""

from __future__ import annotations

import pytest

from ddp_lab.analysis.records import job_records, load_runs
from ddp_lab.config import compose_model
from ddp_lab.models.facts import meta_model, tp_layers
from ddp_lab.spec.parallel import schedule_totals, tp_schedule
from tests.helpers.launching import FAST, assert_same_saved_weights, launch, results

pytestmark = pytest.mark.slow
JOBS = {(1, "lab"): "multirun/0", (2, "lab"): "multirun/1", (2, "torch"): "run"}  # the sweep's, in Hydra's order
TOKENS = 2 * 16  # a rank's micro-batch: train.batch_size=4 over dp=2, model=toy's context of 16


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("mesh")
    common = (*FAST, "logger=none", "world_size=4", "strategy=zero2", "train.save_model=true")
    for overrides, multirun in ((("parallel.tp=1,2",), True), (("parallel.tp=2", "parallel.tp_impl=torch"), False)):
        proc = launch(*common, *overrides, tmp_path=tmp_path, multirun=multirun)
        assert proc.returncode == 0, proc.stderr
    return tmp_path  # its jobs: JOBS


def _job(sweep, tp, impl):
    return sweep / JOBS[tp, impl]


def test_every_mesh_trains_to_the_same_weights(sweep):
    for key in JOBS:
        assert_same_saved_weights(_job(sweep, *key), _job(sweep, 1, "lab"))


def _schedule() -> dict:
    plan, shapes, partial = tp_layers(meta_model(compose_model("toy")))
    return schedule_totals(tp_schedule(plan, shapes, 2, False, TOKENS, partial_grads=partial))


def test_the_tp_axis_is_measured_and_its_collectives_are_the_schedule(sweep):
    lab, torch_tp = results(_job(sweep, 2, "lab")), results(_job(sweep, 2, "torch"))
    want = _schedule()
    for step in lab["steps"]:
        assert step["tp_collectives"] == want["calls"] and step["tp_comm_bytes"] == want["bytes"]
        assert step["tp_comm_ms"] > 0
    counted = torch_tp["summary"]["mesh"]["tp_counted"]
    assert (counted["calls"], counted["bytes"]) == (want["calls"], want["bytes"]) and counted["step"] == 0
    assert "tp_collectives" not in torch_tp["steps"][-1]
    plain = results(_job(sweep, 1, "lab"))
    assert plain["summary"]["mesh"] == {"dp": 4, "tp": 1, "label": "4x1", "tp_inner": True}
    assert "tp_collectives" not in plain["steps"][-1]


def test_the_summary_and_tables_say_the_mesh_and_each_ranks_share(sweep):
    records = {(r["tp"], r["tp_impl"] or "lab"): r for r in job_records([(n, res) for n, res, _ in load_runs(sweep)])}
    assert {r["mesh"] for r in records.values()} == {"4x1", "2x2"}
    lab = records[2, "lab"]
    assert lab["label"] == "zero2-bucket_mb=25.0-tp=2" and records[2, "torch"]["label"].endswith("-tp_impl=torch")
    assert 50 < lab["tp_params_held_pct"] < 51  # the split weights at 1/2, the row-parallel biases whole
    assert lab["tp_collectives_per_step"] == _schedule()["calls"] == records[2, "torch"]["tp_collectives_per_step"]
    assert lab["vs_torch_tp"] is not None and records[1, "lab"]["vs_torch_tp"] is None
    for record in records.values():
        assert 1.0 <= record["model_state_vs_paper"] < 1.05  # zero2 over the dp axis, of what the rank holds
