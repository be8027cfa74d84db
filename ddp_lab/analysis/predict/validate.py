"""`validate`: the model's step for every training job of a sweep, beside what the job measured.

One row per job: predicted and measured p50 step time, predicted and measured p50 exposed comm,
and the step's relative error; jobs the model cannot replay (another model, a strategy without a
schedule), profiled jobs (the profiler slows their steps) and failed jobs are listed with the
reason, never silently dropped. For each bucket
sweep (jobs differing only in `strategy.bucket_mb`) the predicted best bucket size among the sizes
measured is compared with the measured best: how many sweep steps apart they are.
"""

from __future__ import annotations

import statistics

from ddp_lab.analysis.predict.costs import PredictError
from ddp_lab.analysis.predict.schedule import best_bucket_mb, job_step
from ddp_lab.analysis.records import bucket_groups, load_runs, record
from ddp_lab.analysis.tables import task_of


def predict_records(model: dict, sweep_dir) -> tuple[list[dict], list[str]]:
    """(rows, notes): one row per finished training job the model can replay, notes for the rest."""
    rows, notes = [], []
    runs = [(n, r) for n, r, _ in load_runs(sweep_dir) if task_of(r) != "allreduce"]
    if not runs:
        raise PredictError(f"no training job under {sweep_dir}")
    for name, res in runs:
        rec = record(name, res)
        if res.get("status") != "ok" or rec.get("step_p50_ms") is None:
            notes.append(f"{name} ({rec['label']}): {res.get('status')}, not compared")
            continue
        if (res.get("config") or {}).get("profile"):
            notes.append(f"{name} ({rec['label']}): profile=true, its steps carry the profiler's cost; not compared")
            continue
        backend = (res.get("env") or {}).get("backend")
        try:
            step, replayed = job_step(model, res["config"], backend)
        except PredictError as exc:
            notes.append(f"{name} ({rec['label']}): not predicted: {exc}")
            continue
        measured = rec["step_p50_ms"]
        rows.append({**rec, "predicted_step_ms": replayed.step_ms, "predicted_exposed_ms": replayed.exposed_ms,
                     "predicted_comm_ms": replayed.comm_ms, "error": (replayed.step_ms - measured) / measured,
                     "config": res["config"]})
    return rows, notes


def bucket_checks(model: dict, rows: list[dict]) -> list[dict]:
    """Per bucket sweep: the measured best bucket size, the predicted best among the same sizes, and
    how many sweep steps apart they are (the goal: at most one)."""
    checks = []
    for (strategy, model_name, ws, _), group in bucket_groups(rows).items():
        sizes = sorted({r["bucket_mb"] for r in group})
        measured = min(group, key=lambda r: r["step_p50_ms"])["bucket_mb"]
        predicted, _ = best_bucket_mb(model, group[0]["config"], sizes)
        checks.append({"strategy": strategy, "model": model_name, "world_size": ws, "sizes": sizes,
                       "measured_best_mb": measured, "predicted_best_mb": predicted,
                       "steps_apart": abs(sizes.index(measured) - sizes.index(predicted))})
    return checks


def mean_abs_error(rows: list[dict]) -> float:
    return statistics.mean(abs(r["error"]) for r in rows) if rows else float("nan")


HEADER = ["job", "strategy", "ranks", "measured step p50", "predicted step", "error", "measured exposed p50",
          "predicted exposed"]


def _cells(r: dict) -> list[str]:
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    return [r["job"], r["label"], str(r["world_size"]), fmt(r["step_p50_ms"]), fmt(r["predicted_step_ms"]),
            f"{100 * r['error']:+.1f}%", fmt(r.get("exposed_p50_ms")), fmt(r["predicted_exposed_ms"])]


def text_table(rows: list[dict]) -> str:
    table = [HEADER] + [_cells(r) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in table)


def markdown(rows: list[dict], checks: list[dict], notes: list[str]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in _cells(r)) + " |" for r in rows]
    if rows:
        worst = max(rows, key=lambda r: abs(r["error"]))
        lines += ["", f"mean |error| {100 * mean_abs_error(rows):.1f}% over {len(rows)} jobs; worst "
                      f"{worst['label']} at {worst['world_size']} ranks, {100 * worst['error']:+.1f}%."]
    if checks:
        lines += ["", "| bucket sweep | ranks | sizes (MiB) | measured best | predicted best | sweep steps apart |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {c['strategy']} ({c['model']}) | {c['world_size']} | {', '.join(f'{s:g}' for s in c['sizes'])} "
                  f"| {c['measured_best_mb']:g} | {c['predicted_best_mb']:g} | {c['steps_apart']} |" for c in checks]
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines)
