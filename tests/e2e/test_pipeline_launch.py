"""A pipeline through launch.py: `world_size=4 strategy=zero2 parallel.pp=2 parallel.pp_schedule=gpipe,1f1b
parallel.pp_impl=lab,torch parallel.microbatches=2 -m`.

Every job trains to the same weights (train.save_model writes them whole, in the single-process layout); the
summary holds each stage's bubble beside the schedule's formula, the lab's sends are the schedule's count of one
micro-batch's activation; each job draws its schedule as it ran, and the sweep's tables and report carry the
bubble. That every schedule and strategy trains to one process's weights is tests/parity/test_pipeline.py's.
"""

from __future__ import annotations

import pytest

from ddp_lab.analysis.pipeline import schedule_sends
from ddp_lab.analysis.records import job_records, load_runs
from ddp_lab.analysis.report import make_report
from ddp_lab.jobdir import PIPELINE
from tests.helpers.launching import FAST, assert_same_saved_weights, launch, results

pytestmark = pytest.mark.slow
JOBS = {("gpipe", "lab"): 0, ("gpipe", "torch"): 1, ("1f1b", "lab"): 2, ("1f1b", "torch"): 3}  # Hydra's order
ACTIVATION = 1 * 16 * 64 * 4  # a micro-batch: batch 4 over dp 2 over 2 micro-batches, x context x d_model, fp32


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("pipeline")
    proc = launch(*FAST, "logger=none", "world_size=4", "strategy=zero2", "train.save_model=true", "parallel.pp=2",
                  "parallel.pp_schedule=gpipe,1f1b", "parallel.pp_impl=lab,torch", "parallel.microbatches=2",
                  tmp_path=tmp_path, multirun=True)
    assert proc.returncode == 0, proc.stderr
    return tmp_path / "multirun"


def test_every_schedule_and_impl_trains_to_the_same_whole_weights(sweep):
    for job in JOBS.values():
        assert_same_saved_weights(sweep / str(job), sweep / "0")


def test_each_stage_bubble_is_measured_beside_the_formula_and_drawn(sweep):
    for (schedule, impl), job in JOBS.items():
        res = results(sweep / str(job))
        pipeline = res["summary"]["mesh"]["pipeline"]
        assert (pipeline["schedule"], pipeline["impl"], pipeline["microbatches"]) == (schedule, impl, 2)
        assert pipeline["bubble_formula_pct"] == pytest.approx(100 / 3)
        assert res["summary"]["mesh"]["label"] == "2x1x2"  # dp x tp x pp
        for stage in pipeline["per_stage"]:
            assert 0 < stage["bubble_pct"] < 100 and stage["busy_ms"] < stage["span_ms"]
            assert {k[0] for k in stage["action_ms"]} == {"F", "B"}
            if impl == "lab":
                assert stage["p2p_bytes"] == schedule_sends(pipeline, stage["pp_rank"]) * ACTIVATION
                assert stage["activation_peak_bytes"] == stage["activation_microbatch_bytes"] * \
                    pipeline["in_flight_peak"][stage["pp_rank"]]
        assert (sweep / str(job) / PIPELINE).stat().st_size > 0
        assert "pp_bubble_pct" in res["steps"][-1] and ("pp_wait_ms" in res["steps"][-1]) == (impl == "lab")


def test_the_tables_and_report_carry_the_bubble(sweep):
    records = job_records([(n, res) for n, res, _ in load_runs(sweep)])
    assert {r["pipeline"] for r in records} == {"gpipe m=2 lab", "gpipe m=2 torch", "1f1b m=2 lab", "1f1b m=2 torch"}
    for record in records:
        assert record["bubble_schedule_pct"] == pytest.approx(100 / 3) and record["bubble_pct"] > 0
        assert record["bubble_stages_pct"] is not None and record["mesh"] == "2x1x2"
        assert (record["vs_torch_pp"] is not None) == record["pipeline"].endswith("lab")  # the lab's over torch's
        assert "-pp=2-" in record["label"] and record["label"].endswith("-m=2" if "lab" in record["pipeline"] else
                                                                       "-m=2-pp_impl=torch")
    report = make_report(sweep, quiet=True)
    text = (sweep / "report.md").read_text()
    assert "## Pipeline bubble: measured against the schedule's" in text and "unequal stages account for" in text
    assert "report_pipelines.png" in {p.name for p in report["png"]}
