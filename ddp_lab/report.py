"""Turn a sweep's results into what a person reads: a table, report.md, report.csv and plots.

    python -m ddp_lab.report outputs/multirun/DATE/TIME                 # a sweep (or one job folder)
    python -m ddp_lab.report BUCKET_SWEEP --collectives ALLREDUCE_SWEEP   # + the cost model's prediction

Reads every job's results.json under DIR (a failed or missing job is a failed row, not a gap) and
writes next to the runs: report.md (the tables, the failures, the pictures), report.csv (one row per
job, raw numbers), and the PNGs `report_plots` draws when the sweep has what they need:

- report_phases.png: each training job's step split into compute, exposed comm and optimizer;
- report_buckets.png: step time and exposed comm against strategy.bucket_mb, and with an all-reduce
  benchmark at the same world size (`--collectives`, or collective jobs in DIR itself), the cost
  model's predicted curve and best bucket size beside the measured one;
- report_bandwidth.png: busbw and latency against message size per op, world size and backend;
- report_timelines.png: the compute/comm lanes of every profiled job (profile=true), stacked.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from omegaconf import OmegaConf

from ddp_lab.results import CONFIG, RESULTS, read_results
from ddp_lab.tables import _get, collective_rows, comparison_tables, print_table, row_label, task_of, train_rows

MiB = 2**20


# --- finding jobs --------------------------------------------------------------------------------

def _is_job(path: Path) -> bool:
    """results.json, or the config launch.py saves beside Hydra's .hydra/ (a job that never ended)."""
    return (path / RESULTS).exists() or ((path / CONFIG).exists() and (path / ".hydra").is_dir())


def _order(path: Path, root: Path):
    """Numeric job folders (Hydra's 0, 1, ..., 10) in numeric order, whatever their depth."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.relative_to(root).parts]


def find_jobs(root) -> list[Path]:
    """DIR itself if it is a job folder, else every job folder below it (sweeps of sweeps too)."""
    root = Path(root)
    if _is_job(root):
        return [root]
    jobs = {p.parent for name in (RESULTS, CONFIG) for p in root.rglob(name) if _is_job(p.parent)}
    return sorted(jobs, key=lambda p: _order(p, root))


def load_job(job: Path) -> dict:
    """results.json, or for a job killed before anyone wrote it, a 'missing' record with its config."""
    results = read_results(job)
    if results is not None:
        return results
    config = OmegaConf.to_container(OmegaConf.load(job / CONFIG), resolve=True) if (job / CONFIG).exists() else {}
    return {"status": "missing", "error": "no results.json: the job was killed before it ended",
            "config": config, "env": {}, "summary": {}, "steps": []}


def load_runs(root) -> list[tuple[str, dict, Path]]:
    """(name, results, folder) per job; the name is the folder relative to DIR ('.' for DIR)."""
    root = Path(root)
    runs = []
    for job in find_jobs(root):
        name = str(job.relative_to(root)) if job != root else job.name
        runs.append((name, load_job(job), job))
    return runs


# --- one flat record per job (report.csv, and what the plots read) -------------------------------

def _mean(res: dict, key: str):
    return _get(res, "summary", key, "mean")


def train_record(res: dict) -> dict:
    """Raw figures of a training job, and its mean step split into phases (means add up, medians
    do not). The phases (rank means of the loop's laps) fill the step; the exposed comm within
    them is the strategy's own figure (slowest rank), so a straggler's extra compute shows as the
    others' wait, as a user of DDP experiences it, and torch DDP, which waits inside backward(), is
    split like the strategies that wait in finish_gradient_synchronization(). A sharded
    optimizer's wait for its own communication (zero1's parameter broadcasts) is exposed comm
    taken out of the optimizer phase, which keeps only the update itself."""
    cfg = res.get("config") or {}
    fwd_bwd, sync, exposed, opt, step = (_mean(res, k) for k in
                                         ("fwd_bwd_ms", "sync_ms", "exposed_comm_ms", "optimizer_ms", "step_time_ms"))
    compute = other = None
    if None not in (fwd_bwd, sync, exposed, opt, step):
        in_optimizer = min(_mean(res, "exposed_optimizer_comm_ms") or 0.0, exposed, opt)
        in_sync = min(exposed - in_optimizer, fwd_bwd + sync)
        compute, opt, exposed = fwd_bwd + sync - in_sync, opt - in_optimizer, in_sync + in_optimizer
        other = max(0.0, step - compute - exposed - opt)
    return {
        "strategy": _get(cfg, "strategy", "name"), "bucket_mb": _get(cfg, "strategy", "bucket_mb"),
        "model": _get(cfg, "model", "name"), "world_size": cfg.get("world_size"),
        "backend": _get(res, "env", "backend") or _get(cfg, "backend", "name"),
        "measured_steps": _get(res, "summary", "measured_steps"),
        "step_p50_ms": _get(res, "summary", "step_time_ms", "p50"), "step_p90_ms": _get(res, "summary", "step_time_ms", "p90"),
        "step_min_ms": _get(res, "summary", "step_time_ms", "min"), "step_mean_ms": step,
        "comm_p50_ms": _get(res, "summary", "comm_ms", "p50"), "exposed_p50_ms": _get(res, "summary", "exposed_comm_ms", "p50"),
        "compute_mean_ms": compute, "exposed_mean_ms": exposed, "optimizer_mean_ms": opt, "other_mean_ms": other,
        "overlap_pct": _get(res, "summary", "overlap_pct"),
        "trace_overlap_pct": _get(res, "summary", "trace_overlap", "overlap_pct"),
        "collectives_per_step": _get(res, "summary", "collectives_per_step"),
        "comm_bytes_per_step": _get(res, "summary", "comm_bytes_per_step"),
        "opt_state_mib_per_rank": (lambda v: None if v is None else v / MiB)(
            _get(res, "summary", "memory", "optimizer_state_max_rank")),
    }


def collective_record(res: dict) -> dict:
    cfg, s = res.get("config") or {}, res.get("summary") or {}
    return {
        "op": _get(cfg, "task", "op"), "size_mb": _get(cfg, "task", "size_mb"), "bytes": s.get("bytes"),
        "world_size": cfg.get("world_size"),
        "backend": s.get("backend") or _get(res, "env", "backend") or _get(cfg, "backend", "name"),
        "device": s.get("device"), "iters": s.get("iters"),
        **{f"latency_{k}_ms": _get(s, "latency_ms", k) for k in ("p50", "mean", "std", "min", "max", "p90")},
        "algbw_GBps": s.get("algbw_GBps"), "busbw_GBps": s.get("busbw_GBps"),
    }


def record(name: str, res: dict) -> dict:
    task = task_of(res)
    head = {"job": name, "task": task, "status": res.get("status", "missing"), "error": res.get("error"),
            "label": row_label(res)}
    return {**head, **(collective_record(res) if task == "allreduce" else train_record(res))}


def write_csv(records: list[dict], path: Path) -> Path:
    fields: list[str] = []
    for rec in records:
        fields += [k for k in rec if k not in fields]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(records)
    return path


# --- report.md ------------------------------------------------------------------------------------

def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for cells in rows:
        status = cells[header.index("status")]
        cells = [f"**{c}**" if c == status and status != "ok" else c for c in cells]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def cost_model_markdown(predictions: list[dict]) -> str:
    header = ["strategy", "model", "ranks", "gradient MiB", "fit: o (ms)", "fit: w (GB/s)", "fit rel. RMS",
              "predicted best bucket MiB (n_b)", "measured best by step p50", "measured best by exposed p50"]
    rows = [[p["strategy"], str(p["model"]), str(p["world_size"]), f"{p['total_bytes'] / MiB:.3g}",
             f"{p['overhead_s'] * 1e3:.3g}", f"{p['bandwidth_Bps'] / 1e9:.3g}", f"{p['rel_rms']:.2f}",
             f"{p['best_bucket_mb']:.3g} ({p['best_n_buckets']})", f"{p['measured_best_step_mb']:g}",
             f"{p['measured_best_exposed_mb']:g}"] for p in predictions]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def write_markdown(path: Path, root: Path, runs, pictures: dict, predictions: list[dict], notes: list[str]) -> Path:
    train = [(n, r) for n, r, _ in runs if task_of(r) != "allreduce"]
    collective = [(n, r) for n, r, _ in runs if task_of(r) == "allreduce"]
    parts = [f"# Report: {root}", "",
             f"{len(runs)} jobs, {sum(r.get('status') == 'ok' for _, r, _ in runs)} ok. "
             "Times in ms (training: warm-up steps excluded, slowest rank per step); GB/s = 1e9 bytes/s.", ""]
    if train:
        parts += ["## Training", "", markdown_table(*train_rows(train)), ""]
    if collective:
        parts += ["## Collectives", "", markdown_table(*collective_rows(collective)), ""]
    failed = [(n, r) for n, r, _ in runs if r.get("status") != "ok"]
    if failed:
        parts += ["## Jobs that did not end ok", ""] + [f"- `{n}`: {r.get('status')}: {r.get('error')}" for n, r in failed] + [""]
    if predictions:
        parts += ["## Cost model: predicted against measured best bucket size", "",
                  "o and w fitted to the all-reduce benchmark at the same world size and backend "
                  "(docs/cost_model.md); predicted bucket* = sqrt(s * o * w).", "",
                  cost_model_markdown(predictions), ""]
    if notes:
        parts += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    for title, png in pictures.items():
        parts += [f"## {title}", "", f"![{title}]({Path(png).name})", ""]
    path.write_text("\n".join(parts))
    return path


# --- the whole report -----------------------------------------------------------------------------

def make_report(root, collectives=None, out=None, quiet: bool = False) -> dict:
    """Everything `python -m ddp_lab.report` does; returns the paths written and the predictions."""
    from ddp_lab import report_plots as plots

    root = Path(root)
    out = Path(out) if out else root
    out.mkdir(parents=True, exist_ok=True)
    runs = load_runs(root)
    if not runs:
        raise FileNotFoundError(f"no job folders (with {RESULTS} or {CONFIG}) under {root}")
    if not quiet:
        for table in comparison_tables([(n, r) for n, r, _ in runs], f"{root}"):
            print_table(table)
    records = [record(n, r) for n, r, _ in runs]
    bench = [r for _, r, _ in runs if task_of(r) == "allreduce"]
    if collectives:
        bench += [r for _, r, _ in load_runs(collectives) if task_of(r) == "allreduce"]
    predictions, notes = plots.bucket_predictions(records, bench, asked=collectives is not None)
    pictures = {}
    for title, name, draw in (
        ("Step time by phase", "report_phases.png", lambda p: plots.plot_phases(records, p)),
        ("Bucket size", "report_buckets.png", lambda p: plots.plot_buckets(records, predictions, p)),
        ("Bandwidth against message size", "report_bandwidth.png", lambda p: plots.plot_bandwidth(records, p)),
        ("Timelines of profiled jobs", "report_timelines.png", lambda p: plots.plot_timelines(runs, p)),
    ):
        if draw(out / name):
            pictures[title] = out / name
    written = {"csv": write_csv(records, out / "report.csv"),
               "md": write_markdown(out / "report.md", root, runs, pictures, predictions, notes),
               "png": list(pictures.values())}
    return {**written, "predictions": predictions, "notes": notes, "records": records}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_lab.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="a sweep folder (outputs/multirun/DATE/TIME), a folder of sweeps, or one job folder")
    parser.add_argument("--collectives", help="a task=allreduce sweep to fit the cost model from")
    parser.add_argument("-o", "--out", help="where to write the report (default: DIR)")
    args = parser.parse_args(argv)
    try:
        report = make_report(args.dir, args.collectives, args.out)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in report["notes"]:
        print(f"note: {note}")
    for p in [report["md"], report["csv"], *report["png"]]:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
