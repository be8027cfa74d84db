"""A timeline picture from profiler traces: compute and communication lanes per rank, per run.

    python -m ddp_lab.timeline outputs/.../naive outputs/.../overlap --labels naive overlap -o timeline.png

One panel per run (stacked, same time scale, so a longer step looks longer), two lanes per rank.
The communication lane is split into what ran while the rank was computing (hidden) and what it
waited for (exposed): whether a strategy overlaps is visible at a glance. Lanes come from
`arithmetic.traces.lanes`, so the picture and the overlap figure in results.json agree.

Beside each panel, where the run's results.json has `summary.exposure` (a job folder given here, or the
end of a profiled job): one bar per collective in issue order, the ms of the wait after backward spent on
it, coloured by why (arithmetic/skew.py `exposure`): "is my overlap real?" bucket by bucket.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on cluster nodes or in tests
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from ddp_lab.arithmetic import traces as ta  # noqa: E402
from ddp_lab.arithmetic.skew import ISSUED_AFTER, ISSUED_LATE, LATE_PEER, QUEUED  # noqa: E402
from ddp_lab.jobdir import read_results  # noqa: E402

COLORS = {"compute": "#4C72B0", "hidden": "#55A868", "exposed": "#C44E52"}
WHY_COLORS = {ISSUED_AFTER: "#C44E52", ISSUED_LATE: "#DD8452", QUEUED: "#8172B3", LATE_PEER: "#937860"}


def _run_lanes(run) -> list[ta.Lanes]:
    """A run given as a folder, one trace path, or a list of paths / loaded trace dicts."""
    if isinstance(run, (str, Path)):
        run = ta.find_traces(run)
        if not run:
            raise FileNotFoundError(f"no Chrome trace (*.json with traceEvents) under {run}")
    out = []
    for i, tr in enumerate(run):
        trace = tr if isinstance(tr, dict) else ta.load_trace(tr)
        out.append(ta.lanes(trace, rank=i))
    return sorted(out, key=lambda ln: ln.rank if ln.rank is not None else 0)


def _bars(intervals, t0):
    return [((s - t0) / 1e3, (e - s) / 1e3) for s, e in intervals]


def exposure_bars(ax, exposure: dict | None) -> None:
    """One bar per collective in issue order: its exposed ms on the most exposed rank, coloured by why."""
    if not exposure:
        ax.axis("off")
        ax.text(0.5, 0.5, "no per-collective exposure\n(results.json's summary.exposure)", ha="center",
                va="center", fontsize=8, color="0.4", transform=ax.transAxes)
        return
    rows = exposure["per_collective"]
    ax.bar(range(len(rows)), [r["exposed_ms"] for r in rows],
           color=[WHY_COLORS.get(r["why"], "0.7") for r in rows])
    ax.set_title(f"exposed after backward per collective\n(rank {exposure['rank']}, mean of {exposure['steps']} "
                 "steps)", fontsize=8)
    ax.set_xlabel("collective, in issue order (last: the first layers')", fontsize=7)
    ax.set_ylabel("ms", fontsize=7)
    ax.tick_params(labelsize=7)
    whys = [why for why in WHY_COLORS if any(r["why"] == why for r in rows)]
    if whys:
        ax.legend(handles=[Patch(color=WHY_COLORS[why], label=why) for why in whys], loc="upper left",
                  fontsize=5, frameon=False)
    ax.grid(axis="y", alpha=0.3)


def plot_timeline(runs: dict, out, title: str | None = None, exposures: dict | None = None) -> Path:
    """Draw `runs` ({label: folder | trace path | [traces]}) into the PNG `out`; returns its path.
    `exposures` ({label: summary.exposure}): the per-collective bars beside a run's panel."""
    runs = {label: _run_lanes(run) for label, run in runs.items()}
    exposures = exposures or {}
    n_lanes = [2 * len(lanes) for lanes in runs.values()]
    fig, axes = plt.subplots(len(runs), 2, sharex="col", squeeze=False,
                             figsize=(15, 1.0 + sum(0.45 * n + 0.6 for n in n_lanes)),
                             gridspec_kw={"height_ratios": n_lanes, "width_ratios": [4, 1]})
    for bars, label in zip(axes[:, 1], runs):
        exposure_bars(bars, exposures.get(label))
    for ax, (label, lanes) in zip(axes[:, 0], runs.items()):
        t0 = min(ln.start for ln in lanes)
        yticks, ylabels = [], []
        for i, ln in enumerate(lanes):
            rank = ln.rank if ln.rank is not None else i
            y_compute, y_comm = 2 * i, 2 * i + 1
            ax.broken_barh(_bars(ln.compute, t0), (y_compute + 0.1, 0.8), color=COLORS["compute"], linewidth=0)
            hidden = ta.intersect(ln.comm, ln.compute)
            exposed = ta.subtract(ln.comm, ln.compute)
            ax.broken_barh(_bars(exposed, t0), (y_comm + 0.1, 0.8), color=COLORS["exposed"], linewidth=0)
            ax.broken_barh(_bars(hidden, t0), (y_comm + 0.1, 0.8), color=COLORS["hidden"], linewidth=0)
            yticks += [y_compute + 0.5, y_comm + 0.5]
            ylabels += [f"rank {rank} compute", f"rank {rank} comm"]
        for start, _ in lanes[0].steps:
            ax.axvline((start - t0) / 1e3, color="0.6", linestyle=":", linewidth=0.8)
        stats = ta.analyze_run(lanes)
        pct = "n/a" if stats["overlap_pct"] is None else f"{stats['overlap_pct']:.0f}%"
        ax.set_title(f"{label}: overlap {pct}  (per rank: comm {stats['comm_ms']:.3g} ms, "
                     f"{stats['overlap_ms']:.3g} ms of it hidden behind compute)", loc="left", fontsize=10)
        ax.set_yticks(yticks, ylabels, fontsize=8)
        ax.set_ylim(0, 2 * len(lanes))
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("time since the run's first profiled event (ms); dotted lines: profiler steps")
    fig.legend(handles=[Patch(color=COLORS["compute"], label="compute"),
                        Patch(color=COLORS["hidden"], label="comm, hidden (compute running)"),
                        Patch(color=COLORS["exposed"], label="comm, exposed (no compute)")],
               loc="upper right", ncol=3, fontsize=8, frameon=False)

    fig.suptitle(title or "Compute and communication per rank", x=0.01, ha="left", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_lab.timeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="job folders (or trace files), one per run")
    parser.add_argument("--labels", nargs="+", help="one label per run (default: folder names)")
    parser.add_argument("-o", "--out", default="timeline.png", help="PNG to write")
    args = parser.parse_args(argv)
    labels = args.labels or [Path(r).name for r in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"{len(args.runs)} runs but {len(labels)} labels")
    exposures = {}
    for label, run in zip(labels, args.runs):
        results = read_results(Path(run)) if Path(run).is_dir() else None
        exposures[label] = ((results or {}).get("summary") or {}).get("exposure")
    try:
        out = plot_timeline(dict(zip(labels, args.runs)), args.out, exposures=exposures)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
