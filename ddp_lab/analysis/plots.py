"""The report's pictures, drawn from report.py's flat per-job records.

Each `plot_*` returns False (and writes nothing) when the sweep lacks what it needs, so a report
only holds pictures that say something. Failed jobs are drawn as red crosses or labels where
their point or bar would be, never silently dropped.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on cluster nodes or in tests
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from ddp_lab.analysis.accuracy import elapsed_s, is_exact, loss_kind, losses  # noqa: E402
from ddp_lab.analysis.records import bucket_groups, record  # noqa: E402
from ddp_lab.analysis.timeline import plot_timeline  # noqa: E402
from ddp_lab.jobdir import TRACES  # noqa: E402
from ddp_lab.spec.figures import BUSBW, MOE_BUSIEST  # noqa: E402

PHASES = [("compute_mean_ms", "compute (forward + backward)", "#4C72B0"),
          ("exposed_mean_ms", "exposed communication", "#C44E52"),
          ("tp_comm_mean_ms", "tensor-parallel collectives", "#8172B3"),
          ("pp_idle_mean_ms", "pipeline bubble (receives' waits, idle)", "#CCB974"),
          ("optimizer_mean_ms", "optimizer step (the update)", "#DD8452"),
          ("other_mean_ms", "other (timers, bookkeeping)", "#BBBBBB")]
FAILED = "#C44E52"


def _save(fig, path) -> bool:
    if not fig.get_constrained_layout():
        fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _train(records):
    return [r for r in records if r["task"] != "allreduce"]


def labels(records: list[dict]) -> list[str]:
    """Short, distinct labels: the strategy and its knobs, plus model / ranks / mesh when those vary."""
    vary = {k for k in ("model", "world_size", "mesh") if len({r.get(k) for r in records}) > 1}
    out = []
    for r in records:
        label = r["label"] + (f" {r['model']}" if "model" in vary else "") + \
            (f" ws{r['world_size']}" if "world_size" in vary else "") + (f" {r['mesh']}" if "mesh" in vary else "")
        out.append(label)
    if len(set(out)) < len(out):
        out = [f"{r['job']}: {label}" for r, label in zip(records, out)]
    return out


def _mark_failed_x(ax, xs, label: str = "failed job") -> None:
    """Red crosses on the x axis at the failed jobs' x values."""
    if xs:
        ax.plot(xs, [0.0] * len(xs), "x", color=FAILED, markersize=10, mew=2, clip_on=False, label=label,
                transform=blended_transform_factory(ax.transData, ax.transAxes))


# --- step time by phase ---------------------------------------------------------------------------

def plot_phases(records: list[dict], path) -> bool:
    """One horizontal stacked bar per training job: mean compute, exposed comm, optimizer, other."""
    train = _train(records)
    if not train:
        return False
    names = labels(train)
    # Constrained layout sizes the margins to the labels (a sweep's knob labels are long); the
    # legend sits above the bars in its own row, beside the title, never over them.
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.45 * len(train)), layout="constrained")
    y = np.arange(len(train))
    left = np.zeros(len(train))
    for key, legend, color in PHASES:
        widths = np.array([(r.get(key) or 0.0) if r["status"] == "ok" else 0.0 for r in train])
        ax.barh(y, widths, left=left, color=color, label=legend, height=0.6)
        left += widths
    xmax = max([r.get("step_mean_ms") or 0.0 for r in train] + list(left) + [1e-9])
    for i, r in enumerate(train):
        if r["status"] != "ok":
            ax.text(0, i, f"  {r['status'].upper()}: {r.get('error') or ''}"[:90], va="center", color=FAILED,
                    fontsize=8)
        elif r.get("compute_mean_ms") is None and r.get("step_mean_ms") is not None:
            ax.barh(i, r["step_mean_ms"], color="#DDDDDD", height=0.6, hatch="//")
            ax.text(r["step_mean_ms"], i, "  no phase timings in this run", va="center", fontsize=8)
        elif r.get("step_mean_ms") is not None:
            ax.text(max(left[i], r["step_mean_ms"]), i, f" {r['step_mean_ms']:.0f} ms", va="center", fontsize=8)
    ax.set_yticks(y, names, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, xmax * 1.18)
    ax.set_xlabel("mean step time over measured steps (ms)\nphases: mean over ranks; exposed comm: slowest rank",
                  fontsize=9)
    fig.suptitle("Where a training step goes, per job", x=0.01, ha="left")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside upper right", fontsize=8, frameon=False, ncol=4)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


# --- bucket size: measured, and the cost model's prediction ---------------------------------------

def plot_buckets(records: list[dict], predictions: list[dict], path) -> bool:
    """Step time and exposed comm against bucket size, one line per bucket sweep; the prediction
    (dashed) and the best sizes (vertical lines) where a benchmark allowed a fit."""
    groups = bucket_groups(records)
    if not groups:
        return False
    fig, (ax_step, ax_exp) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ((strategy, model, ws, backend), group) in enumerate(groups.items()):
        color, name = colors[i % len(colors)], f"{strategy} {model} ws{ws} {backend}"
        ok = [r for r in group if r["status"] == "ok" and r.get("step_p50_ms") is not None]
        x = [r["bucket_mb"] for r in ok]
        p50 = np.array([r["step_p50_ms"] for r in ok])
        low = p50 - np.array([r.get("step_min_ms") or v for r, v in zip(ok, p50)])
        high = np.array([r.get("step_p90_ms") or v for r, v in zip(ok, p50)]) - p50
        ax_step.errorbar(x, p50, yerr=[low, high], marker="o", color=color, capsize=3, label=f"{name} (p50; min-p90)")
        ax_exp.plot(x, [r.get("exposed_p50_ms") for r in ok], "o-", color=color, label=f"{name}: measured p50")
        failed = [r["bucket_mb"] for r in group if r not in ok]
        _mark_failed_x(ax_step, failed)
        pred = next((p for p in predictions if (p["strategy"], p["model"], p["world_size"], p["backend"])
                     == (strategy, model, ws, backend)), None)
        if pred:
            ax_exp.plot(pred["curve_bucket_mb"], pred["curve_exposed_ms"], "--", color=color,
                        label=f"{name}: cost model (o={pred['overhead_s'] * 1e3:.2g} ms, "
                              f"w={pred['bandwidth_Bps'] / 1e9:.2g} GB/s)")
            for ax in (ax_step, ax_exp):
                ax.axvline(pred["best_bucket_mb"], color=color, linestyle="--", linewidth=1)
                ax.axvline(pred["measured_best_step_mb"], color=color, linestyle=":", linewidth=1.5)
            vertical = {"xycoords": ("data", "axes fraction"), "rotation": 90, "va": "top", "ha": "right",
                        "fontsize": 8, "color": color}
            ax_exp.annotate(f"predicted best {pred['best_bucket_mb']:.3g} MiB", (pred["best_bucket_mb"], 0.97),
                            **vertical)
            ax_step.annotate(f"measured best {pred['measured_best_step_mb']:g} MiB",
                             (pred["measured_best_step_mb"], 0.97), **vertical)
    for ax, title, ylabel in ((ax_step, "Step time against bucket size", "step time (ms)"),
                              (ax_exp, "Exposed communication: measured and predicted", "exposed comm per step (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel("strategy.bucket_mb (MiB)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, loc="left", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, frameon=False, loc="best")
    ax_step.set_ylim(bottom=0)
    if predictions:
        ax_exp.set_yscale("log")  # the model's curve and the measured points can be decades apart
    else:
        ax_exp.set_ylim(bottom=0)
    if predictions:
        fig.text(0.01, 0.005, "dashed vertical: predicted best bucket  ·  "
                 "dotted vertical: measured best (lowest step p50)", fontsize=8, color="0.3")
    return _save(fig, path)


# --- the sharding ladder: memory per rank against step time -----------------------------------------

MARKERS = "osD^vP*X"


def _total_state(record: dict) -> float:
    """Model state + strategy state (MiB); model state alone for results from before strategy state."""
    total = record.get("state_total_mib_per_rank")
    return record["model_state_mib_per_rank"] if total is None else total


def plot_link_rate(records: list[dict], path) -> bool:
    """Mean step time against the emulated link's rate (network=emulated), one line per strategy and knobs,
    log-log; unshaped links at the right edge. Drawn when a sweep has two or more rates. The mean, not the
    p50: a strategy that communicates on some steps only (local_sgd) pays its syncs in the mean."""
    jobs = [r for r in records if r["task"] != "allreduce" and r.get("network") == "emulated"
            and r["status"] == "ok" and r.get("step_mean_ms")]
    rates = sorted({r["link_gbps"] for r in jobs if r["link_gbps"] is not None})
    if len(rates) + any(r["link_gbps"] is None for r in jobs) < 2:
        return False
    unshaped = (rates[-1] * 3) if rates else 1.0
    x_of = lambda r: unshaped if r["link_gbps"] is None else r["link_gbps"]  # noqa: E731
    lines: dict[str, list] = {}
    for r in jobs:
        lines.setdefault(r["label"], []).append((x_of(r), r["step_mean_ms"] / 1e3))
    fig, ax = plt.subplots(figsize=(9, 6), layout="constrained")
    colors = plt.get_cmap("tab20").colors  # more lines than the default cycle's 10 colors
    for i, (label, points) in enumerate(sorted(lines.items())):
        points.sort()
        ax.plot([x for x, _ in points], [y for _, y in points], "os^Dv"[i % 5] + "-", color=colors[i % 20], label=label,
                linewidth=1.2, markersize=4)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = rates + ([unshaped] if any(r["link_gbps"] is None for r in jobs) else [])
    ax.set_xticks(ticks, [f"{t:g}" for t in rates] + (["unshaped"] if len(ticks) > len(rates) else []))
    ax.minorticks_off()
    ax.set_xlabel("each node's link, Gbit/s (network=emulated)")
    ax.set_ylabel("mean step time, s (log scale)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, frameon=False)
    ax.set_title("Step time against link rate", loc="left", fontsize=10)
    return _save(fig, path)


def plot_ladder(records: list[dict], path) -> bool:
    """State kept per rank (x: model state + strategy state) against step time p50 (y, bars p50 to
    p90): one point per training job, coloured by strategy, shaped by world size; a line back to its
    model state alone where the strategy keeps more (buckets, error feedback); a hollow marker at
    the ZeRO paper's figure for the same job. Drawn when two or more strategies have memory
    figures: the trade-off to choose from."""
    train = _train(records)
    ok = [r for r in train if r["status"] == "ok" and r.get("model_state_mib_per_rank") is not None
          and r.get("step_p50_ms") is not None]
    if len({r["strategy"] for r in ok}) < 2:
        return False
    strategies = list(dict.fromkeys(r["strategy"] for r in ok))
    sizes = sorted({r["world_size"] for r in ok}, key=str)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if len(strategies) > len(colors):  # more strategies than the default cycle's 10: one colour each
        colors = plt.get_cmap("tab20").colors
    names = [f"{r['strategy']} ws{r['world_size']}" for r in ok]
    if len(set(names)) < len(names):  # several jobs of one strategy and size: their knobs tell them apart
        names = labels(ok)
    fig, ax = plt.subplots(figsize=(10, 6), layout="constrained")
    for r, name in zip(ok, names):
        color = colors[strategies.index(r["strategy"]) % len(colors)]
        marker = MARKERS[sizes.index(r["world_size"]) % len(MARKERS)]
        model_state, y = r["model_state_mib_per_rank"], r["step_p50_ms"]
        x = _total_state(r)
        high = (r.get("step_p90_ms") or y) - y
        if x > model_state:
            ax.plot([model_state, x], [y, y], color=color, linewidth=2, alpha=0.5, marker="|", markersize=12)
        ax.errorbar([x], [y], yerr=[[0], [high]], marker=marker, color=color, markersize=9, capsize=3)
        if r.get("paper_model_state_mib") is not None:
            ax.plot([r["paper_model_state_mib"]], [y], marker=marker, markersize=9, markerfacecolor="none",
                    color=color, alpha=0.6)
        ax.annotate(f" {name}", (x, y), fontsize=8, color=color, xytext=(4, 4), textcoords="offset points")
    handles = [plt.Line2D([], [], color=colors[i % len(colors)], marker="o", linestyle="", label=s)
               for i, s in enumerate(strategies)]
    handles += [plt.Line2D([], [], color="0.3", marker=MARKERS[i % len(MARKERS)], linestyle="", label=f"{ws} ranks")
                for i, ws in enumerate(sizes)]
    handles.append(plt.Line2D([], [], color="0.3", marker="o", markerfacecolor="none", linestyle="",
                              label="ZeRO paper's figure"))
    handles.append(plt.Line2D([], [], color="0.3", marker="|", markersize=12, linewidth=2, alpha=0.5,
                              label="strategy state (| model state alone)"))
    ax.legend(handles=handles, fontsize=8, frameon=False, loc="best")
    failed = [f"{r['label']} ws{r['world_size']}: {r['status']}" for r in train if r["status"] != "ok"]
    if failed:
        ax.text(0.99, 0.01, "not drawn (did not end ok): " + "; ".join(failed)[:200], transform=ax.transAxes,
                ha="right", va="bottom", fontsize=8, color=FAILED)
    ax.set_xlabel("state kept per rank, largest rank (MiB): params + grads + optimizer state + strategy state")
    ax.set_ylabel("step time p50 (ms); bar up to p90")
    ax.set_xlim(0, 1.25 * max(_total_state(r) for r in ok))  # room for the labels
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.set_title("The sharding ladder: memory each rank holds against the time a step takes", loc="left",
                 fontsize=10)
    return _save(fig, path)


# --- collectives: bandwidth and latency against message size --------------------------------------

def plot_bandwidth(records: list[dict], path) -> bool:
    """busbw and p50 latency against message size, one line per (op, backend, world size)."""
    coll = [r for r in records if r["task"] == "allreduce"]
    if not coll:
        return False
    series = defaultdict(list)
    for r in coll:
        series[(r.get("op_label"), r.get("backend"), r.get("world_size"))].append(r)
    fig, (ax_bw, ax_lat) = plt.subplots(1, 2, figsize=(13, 4.8))
    for (op, backend, ws), rows in sorted(series.items(), key=lambda kv: tuple(str(k) for k in kv[0])):
        ok = sorted((r for r in rows if r["status"] == "ok" and r.get(BUSBW.key) is not None),
                    key=lambda r: r["size_mb"])
        name = f"{op} {backend} {ws} ranks"
        line, = ax_bw.plot([r["size_mb"] for r in ok], [r[BUSBW.key] for r in ok], "o-", label=name)
        ax_lat.plot([r["size_mb"] for r in ok], [r["latency_p50_ms"] for r in ok], "o-", color=line.get_color(),
                    label=name)
        _mark_failed_x(ax_bw, [r["size_mb"] for r in rows if r not in ok and r.get("size_mb")],
                       label=f"{name}: failed")
    ax_bw.set_ylabel("bus bandwidth at p50 latency (GB/s)")
    ax_bw.set_ylim(bottom=0)
    ax_bw.set_title("Bus bandwidth (nccl-tests: algbw × 2(n−1)/n for all-reduce)", loc="left", fontsize=10)
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("p50 latency (ms)")
    ax_lat.set_title("Latency", loc="left", fontsize=10)
    for ax in (ax_bw, ax_lat):
        ax.set_xscale("log")
        ax.set_xlabel("message size (MiB)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, frameon=False)
    return _save(fig, path)


# --- profiled jobs --------------------------------------------------------------------------------

MAX_TIMELINES = 6


def plot_timelines(runs, path) -> bool:
    """Every profiled training job's lanes in one picture (same time scale): naive against overlap."""
    profiled = [(name, res, job) for name, res, job in runs
                if res.get("status") == "ok" and (job / TRACES).is_dir() and any((job / TRACES).glob("*.json"))]
    if not profiled:
        return False
    profiled = profiled[:MAX_TIMELINES]
    names = labels([record(name, res) for name, res, _ in profiled])
    plot_timeline({label: job / TRACES for label, (_, _, job) in zip(names, profiled)}, path,
                  exposures={label: (res.get("summary") or {}).get("exposure")
                             for label, (_, res, _) in zip(names, profiled)})
    return True


def plot_pipelines(runs, path) -> bool:
    """Every pipeline job's last step as it ran, stages as rows (analysis/pipeline.py): at most MAX_TIMELINES."""
    from ddp_lab.analysis.pipeline import pipeline_of, plot_schedules

    jobs = [(name, res) for name, res, _ in runs if res.get("status") == "ok" and pipeline_of(res)]
    if not jobs:
        return False
    jobs = jobs[:MAX_TIMELINES]
    names = labels([record(name, res) for name, res in jobs])
    plot_schedules({label: pipeline_of(res) for label, (_, res) in zip(names, jobs)}, path)
    return True


def plot_expert_load(runs, path) -> bool:
    """The busiest expert's share of the routed slots at every step, one line per mixture-of-experts job, beside an
    even load (1 / experts): how each balancing choice keeps the experts busy (docs/experts.md)."""
    jobs = [(name, res) for name, res, _ in runs
            if any(MOE_BUSIEST.key in step for step in res.get("steps") or [])]
    if not jobs:
        return False
    names = labels([record(name, res) for name, res in jobs])
    fig, ax = plt.subplots(figsize=(9, 4.5), layout="constrained")
    evens = set()
    for (_, res), name in zip(jobs, names):
        steps = [(s["step"], s[MOE_BUSIEST.key]) for s in res["steps"] if MOE_BUSIEST.key in s]
        ax.plot([s for s, _ in steps], [v for _, v in steps], label=name, linewidth=1.2)
        experts = (res.get("config") or {}).get("model", {}).get("experts")
        if experts:
            evens.add(experts)
    for experts in sorted(evens):
        ax.axhline(1 / experts, color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"even: 1/{experts}", (0, 1 / experts), xytext=(2, 2), textcoords="offset points", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert's share of the routed slots\n(worst layer, worst rank)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    ax.set_title("The experts' load per step", loc="left", fontsize=10)
    return _save(fig, path)


# --- accuracy: loss against wall time and against step ---------------------------------------------

def plot_loss(runs, records: list[dict], path) -> bool:
    """Loss against wall time (the sum of step times) and against step, one line per training job
    with losses; the exact reference's lines are solid, every other job's dashed. Drawn for any
    training job with two or more steps. The validation loss where a job measured it at two or more
    steps (analysis/accuracy.py), else the training loss: the axis says which."""
    jobs = [(rec, res) for rec, (_, res, _) in zip(records, runs)
            if rec["task"] != "allreduce" and len(losses(res)) >= 2]
    if not jobs:
        return False
    names = labels([rec for rec, _ in jobs])
    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(13, 5), layout="constrained")
    for (rec, res), name in zip(jobs, names):
        style = "-" if is_exact(res) else "--"
        if rec["status"] != "ok":
            name += f" ({rec['status']})"
        seconds = elapsed_s(res)
        line, = by_time.plot([t for t, _ in seconds], [v for _, v in seconds], style, label=name, linewidth=1.2)
        steps = losses(res)
        by_step.plot([s for s, _ in steps], [v for _, v in steps], style, color=line.get_color(), linewidth=1.2)
    by_time.set_xlabel("wall time (s): sum of step times, warm-up included")
    by_step.set_xlabel("step")
    positive = all(v > 0 for _, res in jobs for _, v in losses(res))
    kinds = sorted({loss_kind(res) for _, res in jobs})
    for ax in (by_time, by_step):
        ax.set_ylabel(" or ".join(kinds) + " loss" + (" (log scale)" if positive else ""))
        if positive:  # the gaps that matter are near the end, where the loss is small
            ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    by_time.legend(fontsize=8, frameon=False)
    by_time.set_title("Loss against wall time (solid: exact fp32 runs)", loc="left", fontsize=10)
    by_step.set_title("Loss against step", loc="left", fontsize=10)
    return _save(fig, path)
