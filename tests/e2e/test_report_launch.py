"""The end-of-sweep table and the report on a real sweep: zero2 at 2 bucket sizes x (rank 1 a 3x straggler,
rank 1 crashing at step 2), profiled (the session's crash sweep, tests/e2e/conftest.py): failed jobs marked,
traces, the merged trace, trace overlap and timelines of the ok ones, the straggler column (empty: 3 measured
steps are too few to name one) and the exposed collectives in the report, the crashed jobs kept in their
bucket sweep."""

import json

import pytest

from ddp_lab.analysis.records import bucket_groups
from ddp_lab.analysis.report import make_report
from ddp_lab.arithmetic.traces import find_traces
from ddp_lab.jobdir import MERGED_TRACE
from tests.helpers.report_fixtures import assert_png, read_csv

pytestmark = pytest.mark.slow


def _ok_jobs(jobs):
    """The jobs whose rank 1 is a straggler, not a crash: they end ok."""
    ok = [i for i, r in jobs.items() if r["config"]["fault"]["kind"] != "crash"]
    assert len(ok) == 2
    return ok


def test_real_sweep_table_marks_failed_jobs(crash_sweep):
    proc, _, jobs = crash_sweep
    assert proc.returncode == 1  # a sweep with failed jobs exits 1
    assert sorted(r["status"] for r in jobs.values()) == ["failed", "failed", "ok", "ok"]
    assert "2 of 4 jobs did not end ok" in proc.stderr
    assert proc.stdout.count("failed") >= 2 and "p50" in proc.stdout


def test_real_sweep_profile_writes_traces_overlap_and_timeline(crash_sweep):
    _, sweep, jobs = crash_sweep
    for i in _ok_jobs(jobs):
        job, summary = sweep / str(i), jobs[i]["summary"]
        assert sorted(p.name for p in (job / "traces").glob("*.json")) == ["rank0.json", "rank1.json"]
        merged = json.loads((job / MERGED_TRACE).read_text())["traceEvents"]  # every rank, one clock (Perfetto)
        names = {e["args"]["name"] for e in merged if e.get("name") == "process_name"}
        assert {n.split(":")[0] for n in names} == {"rank 0", "rank 1"}
        assert min(e["ts"] for e in merged if "ts" in e) == 0 and len({e["pid"] for e in merged}) >= 2
        assert len(find_traces(job)) == 2  # the merged file is not taken for a third rank
        overlap = summary["trace_overlap"]
        assert overlap["profiled_steps"] == [2, 3] and len(overlap["ranks"]) == 2
        # The last step is profiled: its validation loss is measured after the profiler stopped.
        assert [s["step"] for s in jobs[i]["steps"] if "val_loss" in s] == [3]
        assert overlap["comm_ms"] > 0 and overlap["compute_ms"] > 0 and 0 <= overlap["overlap_pct"] <= 100
        assert_png(job / "timeline.png")
        # The step's phases are recorded and fill it (rank means; timers add a little).
        for step in jobs[i]["steps"]:
            phases = step["fwd_bwd_ms"] + step["sync_ms"] + step["optimizer_ms"]
            assert 0.5 * step["step_time_ms"] < phases <= step["step_time_ms"] * 1.01


def test_real_sweep_report(crash_sweep):
    _, sweep, jobs = crash_sweep
    report = make_report(sweep, quiet=True)
    rows = read_csv(sweep / "report.csv")
    assert len(rows) == 4 and sorted(r["status"] for r in rows) == ["failed", "failed", "ok", "ok"]
    md = (sweep / "report.md").read_text()
    training = md.split("## Training")[1].split("\n## ")[0]
    assert training.count("**failed**") == 2 and "injected crash at step 2" in md  # failed rows in bold
    assert training.count("slow 3x rank 1") == 2  # an injected run never passes for a clean one
    named = [j["summary"]["straggler"]["rank"] for j in jobs.values() if j["status"] == "ok"]
    assert training.count("| rank ") == sum(r is not None for r in named)  # the straggler column, where named
    exposure = md.split("## Exposed communication per collective")[1].split("\n## ")[0]
    assert exposure.count("hidden (rank") == 2  # each ok job's collectives, the hidden ones counted
    assert len(bucket_groups(report["records"])) == 1  # the crashed jobs belong to their bucket sweep
    names = {p.name for p in report["png"]}
    assert {"report_phases.png", "report_buckets.png", "report_timelines.png", "report_loss.png"} <= names
    for png in report["png"]:
        assert_png(png)
