"""`predict heldout OUT`: score the predictor on jobs its fit never saw (docs/notebook/predict.md, "Held out").

The protocol, run by benchmarks/predict_heldout.sh into OUT:

    OUT/model.json                 fit from 2-rank measurements only: the collective sweep at 2 ranks
                                   and one profiled run (overlap, 2 ranks)
    OUT/heldout/GROUP/...          jobs on the host, each group scored with OUT/model.json
    OUT/link/RATE/model.json       the same profile, collectives from a 2-rank sweep on the emulated link
    OUT/link/RATE/train/...        jobs on emulated nodes joined by that link, scored with its model

Per group: mean and worst |error| of the p50 step, the same for exposed comm (where it is at least 5%
of the step, as `validate` scores it), and for a bucket sweep the measured loss of taking the
predicted best size instead of the measured best.
"""

from __future__ import annotations

import math
from pathlib import Path

from ddp_lab.analysis.predict import fit as fitting
from ddp_lab.analysis.predict import validate as validating
from ddp_lab.analysis.predict.costs import PredictError

GROUPS = {  # folder under OUT/heldout: what the fit did not see
    "world_sizes": "3 and 4 ranks (the fit saw 2)",
    "strategies": "other strategies at 2 ranks (the profile ran overlap)",
    "data": "text and token files at 2 ranks (the profile ran synthetic data)",
    "buckets": "bucketed at 4 ranks, five bucket sizes",
}


def score(model: dict, folder: Path, what: str) -> dict:
    rows, notes = validating.predict_records(model, folder)
    if not rows:
        raise PredictError(f"no job under {folder} the model can replay: {'; '.join(notes) or 'none finished'}")
    checks = validating.bucket_checks(model, rows)
    exposed = [r for r in rows if r["exposed_error"] is not None]
    worst = max(rows, key=lambda r: abs(r["error"]))
    worst_exposed = max(exposed, key=lambda r: abs(r["exposed_error"])) if exposed else None
    return {"group": folder.name, "what": what, "rows": rows, "notes": notes, "checks": checks, "jobs": len(rows),
            "step": validating.mean_abs_error(rows), "worst_step": worst["error"],
            "worst_step_job": f"{worst['label']} at {worst['world_size']} ranks",
            "exposed": validating.mean_abs_error(rows, "exposed_error"), "exposed_jobs": len(exposed),
            "worst_exposed": None if worst_exposed is None else worst_exposed["exposed_error"],
            "worst_exposed_job": None if worst_exposed is None else
            f"{worst_exposed['label']} at {worst_exposed['world_size']} ranks"}


def run(out) -> list[dict]:
    out = Path(out)
    if not (out / "model.json").exists():
        raise PredictError(f"no {out / 'model.json'}: run benchmarks/predict_heldout.sh {out} first")
    model = fitting.load(out / "model.json")
    groups = [score(model, out / "heldout" / g, what) for g, what in GROUPS.items() if (out / "heldout" / g).is_dir()]
    for link in sorted((out / "link").glob("*"), key=lambda p: float(p.name)) if (out / "link").is_dir() else []:
        groups.append(score(fitting.load(link / "model.json"), link / "train",
                            f"emulated nodes at {link.name} Gbit/s: collectives swept on the link at 2 ranks, "
                            "compute from the host's profile"))
        groups[-1]["group"] = f"link {link.name} Gbit/s"
    if not groups:
        raise PredictError(f"no held-out jobs under {out}/heldout or {out}/link")
    return groups


def _pct(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.1f}%"


def markdown(groups: list[dict]) -> str:
    lines = ["| held out | jobs | mean \\|step error\\| | worst step error | mean \\|exposed error\\| (jobs) "
             "| worst exposed error |", "|---|---|---|---|---|---|"]
    for g in groups:
        lines.append(f"| {g['group']}: {g['what']} | {g['jobs']} | {_pct(g['step'])} | {100 * g['worst_step']:+.1f}% "
                     f"({g['worst_step_job']}) | {_pct(g['exposed'])} ({g['exposed_jobs']}) | "
                     + ("-" if g["worst_exposed"] is None else
                        f"{100 * g['worst_exposed']:+.1f}% ({g['worst_exposed_job']})") + " |")
    every = [r for g in groups for r in g["rows"]]
    lines += ["", validating.overall_line(every)]
    for g in groups:
        lines += [line for line in validating.summary_lines(g["rows"], g["checks"]) if line.startswith("best bucket")]
    for g in groups:
        lines += ["", f"#### {g['group']}", "", validating.markdown(g["rows"], g["checks"], g["notes"])]
    return "\n".join(lines)
