"""Overlap from traces: interval arithmetic by hand, synthetic traces with known intervals, and a
real 2-rank gloo profile proving the classification finds torch 2.13's communication events."""

import json
import os

import pytest

from ddp_lab.arithmetic import traces as ta
from ddp_lab.check.ranks import run_ranks


def test_interval_arithmetic():
    assert ta.merge([(5, 7), (0, 2), (1, 3), (9, 9)]) == [(0, 3), (5, 7)]
    assert ta.total([(0, 10), (5, 15), (20, 25)]) == 20
    assert ta.intersect([(0, 10), (20, 30)], [(5, 25)]) == [(5, 10), (20, 25)]
    assert ta.subtract([(0, 10), (20, 30)], [(2, 4), (8, 22)]) == [(0, 2), (4, 8), (22, 30)]
    assert ta.subtract([(0, 10)], []) == [(0, 10)]
    assert ta.intersect([], [(0, 1)]) == []


def _x(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}


def synthetic_host_trace(rank=0, shift=0.0):
    """Main thread (tid 1) computes [0,100] and [150,300] and launches an all-reduce at [60,70]
    from inside the first compute op; gloo's thread (tid 2) runs collectives [50,200], [250,400].

    compute = [0,60] + [70,100] + [150,300] + [320,330] = 250 us; comm = [50,200] + [250,400]
    = 300 us; compute during comm = [50,60] + [70,100] + [150,200] + [250,300] + [320,330]
    = 150 us -> 50 %.
    """
    events = [
        {"ph": "M", "name": "thread_name", "pid": 7, "tid": 2, "args": {"name": "pt_gloo_runloop"}},
        _x("ProfilerStep#3", 0, 400, cat="user_annotation"),       # spans everything: not compute
        _x("train.py(12): step", 0, 400, cat="python_function"),   # python stack: not compute
        _x("aten::mm", 0, 100),
        _x("aten::addmm", 10, 20),                                  # nested compute: counted once
        _x("c10d::allreduce_", 60, 10),                             # launch inside compute
        _x("aten::mm", 150, 150),
        _x("gloo:all_reduce", 50, 150, cat="user_annotation", tid=2),
        _x("gloo:all_reduce", 250, 150, cat="user_annotation", tid=2),
        _x("aten::broadcast_tensors", 320, 10),                    # 'broadcast' in name, still compute
    ]
    for e in events:
        if "ts" in e:
            e["ts"] += shift
    return {"distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2}, "traceEvents": events}


def test_overlap_on_synthetic_host_trace():
    lanes = ta.lanes(synthetic_host_trace())
    assert lanes.mode == "host" and lanes.rank == 0
    assert lanes.compute == [(0, 60), (70, 100), (150, 300), (320, 330)]
    assert lanes.comm == [(50, 200), (250, 400)]
    s = ta.overlap_stats(lanes)
    assert s["comm_ms"] == pytest.approx(0.300)
    assert s["overlap_ms"] == pytest.approx(0.150)
    assert s["overlap_pct"] == pytest.approx(50.0)


def test_overlap_on_synthetic_device_trace():
    # GPU trace: host ops are launches; kernels decide. Compute kernels [0,100], [120,220] on stream 7,
    # NCCL kernel [80,180] on stream 20: overlap = [80,100] + [120,180] = 80 of 100 -> 80 %.
    events = [
        _x("aten::mm", 0, 500),                                    # host op: ignored on a GPU trace
        _x("c10d::allreduce_", 70, 5),
        _x("sm90_xmma_gemm_bf16", 0, 100, cat="kernel", tid=7),
        _x("sm90_xmma_gemm_bf16", 120, 100, cat="kernel", tid=7),
        _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 80, 100, cat="kernel", tid=20),
        _x("Memcpy HtoD (Pageable -> Device)", 0, 300, cat="gpu_memcpy", tid=7),
    ]
    s = ta.overlap_stats({"traceEvents": events})
    assert s["mode"] == "device"
    assert s["comm_ms"] == pytest.approx(0.1) and s["compute_ms"] == pytest.approx(0.2)
    assert s["overlap_pct"] == pytest.approx(80.0)


def test_no_comm_means_no_overlap_figure():
    assert ta.overlap_stats({"traceEvents": [_x("aten::mm", 0, 10)]})["overlap_pct"] is None


def _profile_rank(rank, world_size, out_dir):
    """One small MLP trained two ways under torch.profiler: all-reduce after backward (naive),
    and async all-reduce launched from each gradient's hook (overlapped). Writes one trace per
    rank per variant, as the trainer will with profile=true."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    x = torch.randn(128, 512)
    handles = []
    hooks = []

    def step(overlap):
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        if overlap:
            for h in handles:
                h.wait()
            handles.clear()
        else:
            for p in model.parameters():
                dist.all_reduce(p.grad)

    paths = {}
    for variant in ("naive", "overlap"):
        if variant == "overlap":
            hooks = [p.register_post_accumulate_grad_hook(
                lambda p: handles.append(dist.all_reduce(p.grad, async_op=True))) for p in model.parameters()]
        step(variant == "overlap")  # warm-up outside the profiler
        path = os.path.join(out_dir, variant, f"trace_rank{rank}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
                     on_trace_ready=lambda prof, path=path: prof.export_chrome_trace(path)) as prof:
            for _ in range(3):
                step(variant == "overlap")
                prof.step()
        paths[variant] = path
    for h in hooks:
        h.remove()
    return paths


@pytest.fixture(scope="module")
def real_traces(tmp_path_factory):
    out = tmp_path_factory.mktemp("traces")
    run_ranks(_profile_rank, 2, str(out))
    return out


def test_real_trace_classification(real_traces):
    naive = ta.find_traces(real_traces / "naive")
    assert [ta.trace_rank(ta.load_trace(p)) for p in naive] == [0, 1]
    trace = ta.load_trace(naive[0])
    kinds = {}
    for ev in trace["traceEvents"]:
        kind = ta.classify_event(ev)
        if kind:
            kinds.setdefault(kind, set()).add(ev["name"])
    # What torch 2.13 records for gloo: the call and the work on gloo's thread.
    assert {"c10d::allreduce_", "gloo:all_reduce"} <= kinds["comm"], kinds.get("comm")
    assert "aten::mm" in kinds["compute"] or "aten::addmm" in kinds["compute"]
    assert not any(n.startswith("ProfilerStep") for n in kinds["compute"])


def test_real_trace_overlap(real_traces):
    naive = ta.analyze_run(ta.find_traces(real_traces / "naive"))
    overlap = ta.analyze_run(ta.find_traces(real_traces / "overlap"))
    for run in (naive, overlap):
        assert len(run["ranks"]) == 2 and all(r["comm_ms"] > 0 and r["compute_ms"] > 0 for r in run["ranks"])
    # Blocking all-reduce after backward: nothing computes while it runs. Hooks: backward continues.
    assert naive["overlap_pct"] < 5
    assert overlap["overlap_pct"] > naive["overlap_pct"] + 10
    json.dumps(overlap)  # results.json-ready


def test_timeline_png(real_traces, tmp_path):
    from ddp_lab.analysis.timeline import plot_timeline

    out = plot_timeline({"naive": real_traces / "naive", "overlap": real_traces / "overlap"}, tmp_path / "t.png")
    assert out.stat().st_size > 10_000
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    one = plot_timeline({"synthetic": [synthetic_host_trace(0), synthetic_host_trace(1, shift=30)]}, tmp_path / "s.png")
    assert one.stat().st_size > 5_000
    from ddp_lab.analysis.timeline import main
    assert main([str(real_traces / "naive"), "-o", str(tmp_path / "cli.png")]) == 0
    assert (tmp_path / "cli.png").stat().st_size > 5_000


def test_the_timeline_has_a_bar_per_collective_coloured_by_why_it_was_exposed(tmp_path):
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    from ddp_lab.analysis.timeline import WHY_COLORS, exposure_bars, plot_timeline
    from ddp_lab.arithmetic.skew import ISSUED_AFTER, ISSUED_LATE

    exposure = {"rank": 1, "steps": 5, "per_collective": [
        {"collective": 0, "bytes": 100, "exposed_ms": 0.0, "issued_before_end_ms": 40.0, "why": None},
        {"collective": 1, "bytes": 100, "exposed_ms": 3.0, "issued_before_end_ms": 2.0, "why": ISSUED_LATE},
        {"collective": 2, "bytes": 50, "exposed_ms": 9.0, "issued_before_end_ms": -1.0, "why": ISSUED_AFTER}]}
    fig, ax = plt.subplots()
    exposure_bars(ax, exposure)
    assert [bar.get_height() for bar in ax.patches] == [0.0, 3.0, 9.0]
    assert [to_hex(bar.get_facecolor()) for bar in ax.patches[1:]] == [
        to_hex(WHY_COLORS[ISSUED_LATE]), to_hex(WHY_COLORS[ISSUED_AFTER])]
    plt.close(fig)
    traces = [synthetic_host_trace(0), synthetic_host_trace(1, shift=30)]
    with_bars = plot_timeline({"s": traces}, tmp_path / "bars.png", exposures={"s": exposure})
    without = plot_timeline({"s": traces}, tmp_path / "plain.png")
    assert with_bars.read_bytes() != without.read_bytes()
