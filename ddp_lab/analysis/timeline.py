"""A timeline picture from profiler traces: compute and communication lanes per rank, per run.

    python -m ddp_lab.timeline outputs/.../naive outputs/.../overlap --labels naive overlap -o timeline.png

One panel per run (stacked, same time scale, so a longer step looks longer), two lanes per rank.
The communication lane is split into what ran while the rank was computing (hidden) and what it
waited for (exposed): whether a strategy overlaps is visible at a glance. Lanes come from
`arithmetic.traces.lanes`, so the picture and the overlap figure in results.json agree.
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

COLORS = {"compute": "#4C72B0", "hidden": "#55A868", "exposed": "#C44E52"}


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


def plot_timeline(runs: dict, out, title: str | None = None) -> Path:
    """Draw `runs` ({label: folder | trace path | [traces]}) into the PNG `out`; returns its path."""
    runs = {label: _run_lanes(run) for label, run in runs.items()}
    n_lanes = [2 * len(lanes) for lanes in runs.values()]
    fig, axes = plt.subplots(len(runs), 1, sharex=True, squeeze=False,
                             figsize=(12, 1.0 + sum(0.45 * n + 0.6 for n in n_lanes)),
                             gridspec_kw={"height_ratios": n_lanes})
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
    try:
        out = plot_timeline(dict(zip(labels, args.runs)), args.out)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
