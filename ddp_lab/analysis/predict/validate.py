"""`validate`: the model's step for every training job of a sweep, beside what the job measured.

One row per job: predicted and measured p50 step time and p50 exposed comm, and the relative error
of each; jobs the model cannot replay (another model, a strategy without a schedule), profiled
jobs (the profiler slows their steps) and failed jobs are listed with the reason, never silently
dropped. The replay runs ranks alike, so its exposed comm is what the rank that ends backward last
waits: it is scored against the least-waiting rank's p50 (`exposed_comm_min_rank_ms`; results
written before that figure existed: the most-waiting rank's, said in the row's `exposed_basis`).
The most-waiting rank's figure (the job's headline exposed comm) is shown beside it; the gap
between the two is the ranks' skew. Exposed comm is scored where it is at least `EXPOSED_FLOOR` of
the measured step: below that its relative error is noise over a near-zero figure (local_sgd
between averagings), and the row shows it as "-". Per strategy: mean |error| of step and of
exposed comm.

For each bucket sweep (jobs differing only in `strategy.bucket_mb`), the bucket choice against
chance: the measured loss of taking the predicted best size instead of the measured best (%), the
loss a size drawn at random would cost on average, and the rank agreement of predicted and measured
steps over all sizes (Spearman's rho; with the chance a random order agrees as well or better, exact
over every order of up to 8 sizes).
"""

from __future__ import annotations

import itertools
import math
import statistics

from ddp_lab.analysis.predict.costs import PredictError
from ddp_lab.analysis.predict.schedule import best_bucket_mb, job_step
from ddp_lab.analysis.records import bucket_groups, load_runs, record, task_of


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
        least = rec.get("exposed_min_rank_p50_ms")
        exposed = least if least is not None else rec.get("exposed_p50_ms")
        scored = exposed is not None and exposed >= EXPOSED_FLOOR * measured
        rows.append({**rec, "predicted_step_ms": replayed.step_ms, "predicted_exposed_ms": replayed.exposed_ms,
                     "predicted_comm_ms": replayed.comm_ms, "error": (replayed.step_ms - measured) / measured,
                     "exposed_basis": "least-waiting rank" if least is not None else "most-waiting rank",
                     "exposed_error": (replayed.exposed_ms - exposed) / exposed if scored else None,
                     "config": res["config"]})
    return rows, notes


EXPOSED_FLOOR = 0.05  # exposed comm is scored where it is at least this share of the measured step


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties take their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else 0.0


def chance_of_rho(rho: float, n: int) -> float | None:
    """The share of all n! orders of n sizes whose rank agreement is at least `rho` (None above 8)."""
    if n > 8:
        return None
    base = list(range(n))
    perms = list(itertools.permutations(base))
    return sum(spearman(base, list(p)) >= rho - 1e-12 for p in perms) / len(perms)


def bucket_checks(model: dict, rows: list[dict]) -> list[dict]:
    """Per bucket sweep (module docstring): measured and predicted best size, how many sweep steps apart
    they are, the measured loss of the predicted choice against a random one, the rank agreement."""
    checks = []
    for (strategy, model_name, ws, _), group in bucket_groups(rows).items():
        sizes = sorted({r["bucket_mb"] for r in group})
        measured_ms = {mb: statistics.median(r["step_p50_ms"] for r in group if r["bucket_mb"] == mb) for mb in sizes}
        predicted, predicted_ms = best_bucket_mb(model, group[0]["config"], sizes)
        measured = min(measured_ms, key=measured_ms.get)
        best = measured_ms[measured]
        rho = spearman([predicted_ms[mb] for mb in sizes], [measured_ms[mb] for mb in sizes])
        checks.append({"strategy": strategy, "model": model_name, "world_size": ws, "sizes": sizes,
                       "measured_best_mb": measured, "predicted_best_mb": predicted,
                       "steps_apart": abs(sizes.index(measured) - sizes.index(predicted)),
                       "loss": measured_ms[predicted] / best - 1,
                       "chance_loss": statistics.mean(measured_ms[mb] / best - 1 for mb in sizes),
                       "rho": rho, "chance_of_rho": chance_of_rho(rho, len(sizes))})
    return checks


def mean_abs_error(rows: list[dict], key: str = "error") -> float:
    values = [abs(r[key]) for r in rows if r.get(key) is not None]
    return statistics.mean(values) if values else float("nan")


def per_strategy(rows: list[dict]) -> list[dict]:
    """Mean |error| of step and of exposed comm for each strategy label's jobs, in first-seen order."""
    out = []
    for label in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == label]
        out.append({"strategy": label, "jobs": len(mine), "step": mean_abs_error(mine),
                    "exposed": mean_abs_error(mine, "exposed_error"),
                    "exposed_jobs": sum(r["exposed_error"] is not None for r in mine)})
    return out


HEADER = ["job", "strategy", "ranks", "measured step p50", "predicted step", "error",
          "measured exposed p50, least / most waiting rank", "predicted exposed", "exposed error"]


def _pct(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{100 * v:+.1f}%"


def _cells(r: dict) -> list[str]:
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    least = fmt(r.get("exposed_min_rank_p50_ms")) if r["exposed_basis"] == "least-waiting rank" else "?"
    return [r["job"], r["label"], str(r["world_size"]), fmt(r["step_p50_ms"]), fmt(r["predicted_step_ms"]),
            _pct(r["error"]), f"{least} / {fmt(r.get('exposed_p50_ms'))}", fmt(r["predicted_exposed_ms"]),
            _pct(r["exposed_error"])]


def overall_line(rows: list[dict]) -> str:
    """Mean |error| of step and of exposed comm over every job, and what the exposed error is against."""
    bases = sorted({r["exposed_basis"] for r in rows})
    floor = f"against the {' or '.join(bases)}'s p50, where it is >= {100 * EXPOSED_FLOOR:g}% of the step"
    return (f"mean |error|: step {100 * mean_abs_error(rows):.1f}% over {len(rows)} jobs, exposed comm "
            f"{100 * mean_abs_error(rows, 'exposed_error'):.1f}% over "
            f"{sum(r['exposed_error'] is not None for r in rows)} ({floor})")


def summary_lines(rows: list[dict], checks: list[dict]) -> list[str]:
    """The scores in words: mean |error| overall and per strategy, each bucket choice against chance."""
    lines = [overall_line(rows)]
    for s in per_strategy(rows):
        exposed = "-" if math.isnan(s["exposed"]) else f"{100 * s['exposed']:.1f}% ({s['exposed_jobs']} jobs)"
        lines.append(f"  {s['strategy']}: step {100 * s['step']:.1f}% ({s['jobs']} jobs), exposed {exposed}")
    for c in checks:
        chance = ("" if c["chance_of_rho"] is None
                  else f", {100 * c['chance_of_rho']:.1f}% of random orders agree as well")
        lines.append(f"best bucket ({c['strategy']}, {c['world_size']} ranks, {len(c['sizes'])} sizes "
                     f"{', '.join(f'{s:g}' for s in c['sizes'])} MiB): measured {c['measured_best_mb']:g}, predicted "
                     f"{c['predicted_best_mb']:g}; choosing the predicted costs {100 * c['loss']:.1f}% "
                     f"(a random size: {100 * c['chance_loss']:.1f}%); rank agreement rho {c['rho']:+.2f}{chance}")
    return lines


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
        lines += ["", "| strategy | jobs | mean \\|step error\\| | mean \\|exposed error\\| (jobs scored) |",
                  "|---|---|---|---|"]
        for s in per_strategy(rows):
            exposed = "-" if math.isnan(s["exposed"]) else f"{100 * s['exposed']:.1f}%"
            lines.append(f"| {s['strategy']} | {s['jobs']} | {100 * s['step']:.1f}% | {exposed} "
                         f"({s['exposed_jobs']}) |")
        lines += ["", overall_line(rows) + f"; worst step {worst['label']} at {worst['world_size']} ranks, "
                  f"{100 * worst['error']:+.1f}%."]
    if checks:
        lines += ["", "| bucket sweep | ranks | sizes (MiB) | measured best | predicted best | sweep steps apart "
                      "| loss of the predicted choice | loss of a random size | rank agreement (rho) "
                      "| random orders as good |", "|---|---|---|---|---|---|---|---|---|---|"]
        for c in checks:
            sizes = ", ".join(f"{s:g}" for s in c["sizes"])
            chance = "-" if c["chance_of_rho"] is None else f"{100 * c['chance_of_rho']:.1f}%"
            lines.append(f"| {c['strategy']} ({c['model']}) | {c['world_size']} | {sizes} | {c['measured_best_mb']:g} "
                         f"| {c['predicted_best_mb']:g} | {c['steps_apart']} | {100 * c['loss']:.1f}% "
                         f"| {100 * c['chance_loss']:.1f}% | {c['rho']:+.2f} | {chance} |")
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines)
