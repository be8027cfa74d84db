"""Turn a sweep's results into what a person reads: a table, report.md, report.csv and plots.

    python -m ddp_lab.report outputs/multirun/DATE/TIME                 # a sweep (or one job folder)
    python -m ddp_lab.report BUCKET_SWEEP --collectives ALLREDUCE_SWEEP   # + the cost model's prediction
    python -m ddp_lab.report SWEEP --model model.json      # + the step-time model's prediction per job

Reads every job's results.json under DIR (a failed or missing job is a failed row, not a gap) and
writes next to the runs: report.md (the tables, the failures, the pictures), report.csv (one row per
job, raw numbers), and the PNGs analysis/plots.py draws when the sweep has what they need:

- report_phases.png: each training job's step split into compute, exposed comm and optimizer;
- report_buckets.png: step time and exposed comm against strategy.bucket_mb, and with an all-reduce
  benchmark at the same world size (`--collectives`, or collective jobs in DIR itself), the cost
  model's predicted curve and best bucket size beside the measured one;
- report_bandwidth.png: busbw and latency against message size per op, world size and backend;
- report_timelines.png: the compute/comm lanes of every profiled job (profile=true), stacked;
- report_ladder.png: model state per rank against step time p50, one point per strategy and world
  size, when training jobs of two or more strategies have memory figures (the sharding ladder);
- report_loss.png: loss against wall time (one line per job) and loss against step.
- report_link_rate.png: mean step time against the emulated link's rate, one line per strategy
  (a sweep over network.gbps on network=emulated).

report.md also gets "Model state per rank: measured vs ZeRO paper" when jobs have memory figures;
"Accuracy cost" (analysis/accuracy.py): per training job the final loss, its gap to the sweep's
exact fp32 run of the same model, bytes on the wire per step and the time to reach a target loss
(the exact run's final loss + 5%, or `--target-loss X`); and with `--model` (a file from
`python -m ddp_lab.predict fit`) "Predicted vs measured": each training job's predicted p50 step and
exposed comm beside the measured ones (report.csv gets `predicted_step_ms`, `predicted_exposed_ms`,
`prediction_error`).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from ddp_lab.analysis import plots
from ddp_lab.analysis.accuracy import TARGET_MARGIN
from ddp_lab.analysis.columns import Column, markdown, table
from ddp_lab.analysis.cost_model import bucket_predictions
from ddp_lab.analysis.pipeline import verdict
from ddp_lab.analysis.predict import fit as predict_fit
from ddp_lab.analysis.predict import validate as predict_validate
from ddp_lab.analysis.records import job_records, load_runs, task_of
from ddp_lab.analysis.tables import COLLECTIVES, TRAINING, check_columns, print_records
from ddp_lab.jobdir import CONFIG, RESULTS
from ddp_lab.units import MiB


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

COST_MODEL = [  # the cost model's prediction per bucket sweep (analysis/cost_model.py's predictions)
    Column("strategy", "strategy"), Column("model", "model", "{}"), Column("ranks", "world_size", "{}"),
    Column("gradient MiB", "total_mib", "{:.3g}", "fit"), Column("fit: o (ms)", "overhead_ms", "{:.3g}", "fit"),
    Column("fit: w (GB/s)", "bandwidth_GBps", "{:.3g}", "fit"), Column("fit rel. RMS", "rel_rms", "{:.2f}", "fit"),
    Column("predicted best bucket MiB (n_b)", "predicted_best", group="fit"),
    Column("measured best by step p50", "measured_best_step_mb", "{:g}", "fit"),
    Column("measured best by exposed p50", "measured_best_exposed_mb", "{:g}", "fit"),
]


def cost_model_markdown(predictions: list[dict]) -> str:
    rows = [{**p, "total_mib": p["total_bytes"] / MiB, "overhead_ms": p["overhead_s"] * 1e3,
             "bandwidth_GBps": p["bandwidth_Bps"] / 1e9,
             "predicted_best": f"{p['best_bucket_mb']:.3g} ({p['best_n_buckets']})"} for p in predictions]
    return markdown(*table(rows, COST_MODEL, keep_empty=True))


IDENTITY_MD = [Column("job", "job"), Column("strategy", "label"), Column("ranks", "world_size", "{}")]
MEMORY = IDENTITY_MD + [Column("stage", "zero_stage", "{}"), Column("dtype", "state_dtype")] + [
    Column(header, key, "{:.3f}" if key == "model_state_vs_paper" else "{:.1f}", "memory") for header, key in (
        ("params", "params_mib_per_rank"), ("grads", "grads_mib_per_rank"), ("optimizer", "opt_mib_per_rank"),
        ("model state", "model_state_mib_per_rank"), ("paper: params", "paper_params_mib"),
        ("paper: grads", "paper_grads_mib"), ("paper: optimizer", "paper_opt_mib"),
        ("paper: model state", "paper_model_state_mib"), ("× paper", "model_state_vs_paper"),
        ("paper, mixed 2+2+12", "paper_mixed_model_state_mib"), ("strategy state", "strategy_state_mib_per_rank"),
        ("total", "state_total_mib_per_rank"), ("activations", "activations_mib_per_rank"),
        ("live tensors", "live_tensors_mib"),
        ("peak gathered", "peak_gathered_mib"), ("max allocated", "max_memory_allocated_mib"))
]  # MiB of the largest rank; × paper with the 3 digits its bar (1.05) needs


def memory_markdown(records: list[dict]) -> str | None:
    """Measured model state per rank beside the ZeRO paper's figure for each training job's stage."""
    rows = [r for r in records if r["task"] != "allreduce" and r.get("model_state_mib_per_rank") is not None]
    return markdown(*table(rows, MEMORY)) if rows else None


ACCURACY = IDENTITY_MD + [Column("status", "status")] + [Column(h, k, f, "accuracy") for h, k, f in (
    ("loss", "loss_kind", "{}"), ("final loss", "final_loss", "{:.4f}"),
    ("val loss after the last step", "final_val_loss", "{:.4f}"), ("exact run", "reference_job", "{}"),
    ("chosen as", "reference_why", "{}"),
    ("exact final loss", "reference_loss", "{:.4f}"), ("Δ loss", "loss_gap", "{:+.4f}"),
    ("Δ loss %", "loss_gap_pct", "{:+.2f}"), ("wire MiB/step", "comm_mib_per_step", "{:.3f}"),
    ("× exact bytes", "bytes_vs_reference", "{:.2f}"), ("step p50 ms", "step_p50_ms", "{:.1f}"),
    ("target loss", "target_loss", "{:.4f}"), ("s to target", "time_to_target_s", "{:.2f}"),
    ("step at target", "steps_to_target", "{}"), ("grad error (mean)", "grad_error_mean", "{:.2e}"),
)]


def accuracy_markdown(records: list[dict], target_loss: float | None) -> str | None:
    """The accuracy cost of every training job with losses: what it saved beside what it lost."""
    rows = [r for r in records if r["task"] != "allreduce" and r.get("final_loss") is not None]
    if not rows:
        return None
    target = (f"the target loss is {target_loss:g} (--target-loss)" if target_loss is not None else
              f"the target loss is the exact run's final loss + {TARGET_MARGIN:.0%}")
    intro = ("The exact run: a job with fp32 compute, fp32 on the wire and an exact average (no powersgd rank or "
             "local_sgd sync_every) that differs from the row only in the strategy and train.precision (same model, "
             "data, world size and training settings): the one `--reference JOB` names when given, else the row's own "
             "strategy where the sweep has it, else the only such configuration; \"chosen as\" says which rule, or "
             "why a row has none. Δ = final loss − its final loss. "
             f"Time to target: the sum of step times until the first step at or below the target; {target}. "
             "Loss (the \"loss\" column says which) is the validation loss where the job measured it every "
             "train.eval_every steps, else the per-step training loss (raw, not smoothed); grad error: "
             "measure.grad_error's ||delivered − exact|| / ||exact|| per step, averaged.")
    return intro + "\n\n" + markdown(*table(rows, ACCURACY, keep_empty=True))


EXPOSURE = [Column("job", "job"), Column("collective", "collective", "{}"), Column("KiB", "kib", "{:.1f}", "exposure"),
            Column("exposed ms", "exposed_ms", "{:.2f}", "exposure"),
            Column("issued ms before backward's end", "issued_before_end_ms", "{:.2f}", "exposure"),
            Column("why", "why", "{}", "exposure")]


def exposure_markdown(runs) -> str | None:
    """Per training job, each collective a step waited for after backward (summary.exposure): "is my overlap
    real?" answered per bucket. Collectives hidden in every step are counted, not listed."""
    rows, hidden = [], []
    for name, res, _ in runs:
        exposure = (res.get("summary") or {}).get("exposure")
        if not exposure:
            continue
        issued = exposure["per_collective"]
        shown = [c for c in issued if c["why"]]
        rows += [{"job": name, "kib": c["bytes"] / 1024, **c} for c in shown]
        hidden.append(f"{name}: {len(issued) - len(shown)} of {len(issued)} hidden (rank {exposure['rank']}, "
                      f"{exposure['steps']} steps)")
    if not rows and not hidden:
        return None
    intro = ("Collectives in issue order (the last issued holds the first layers' gradients), on the most exposed "
             "rank, means over the measured steps of the step's usual shape; exposed: the part of the wait after "
             "backward spent on this collective (docs/scale.md, \"Stragglers\": a late peer, queued behind "
             "earlier collectives on the link, issued late, or issued after backward ended). Hidden: never "
             "waited for. " + "; ".join(hidden) + ".")
    return intro + ("\n\n" + markdown(*table(rows, EXPOSURE)) if rows else "")


PIPELINE_INTRO = ("The schedule's bubble is the published formula ((p-1)/(m+p-1), over v when interleaved), zero "
                  "bubble's its own on paper; it assumes equal stages and free sends. Replayed: the same schedule at "
                  "each stage's measured compute, sends still free (ddp_lab/analysis/pipeline.py). Measured: each "
                  "stage rank's step span less its compute, mean over stage ranks and measured steps.")


def write_markdown(path: Path, root: Path, runs, pictures: dict, predictions: list[dict], notes: list[str],
                   records: list[dict], step_model: str | None = None, target_loss: float | None = None) -> Path:
    train = [r for r in records if r["task"] != "allreduce"]
    collective = [r for r in records if r["task"] == "allreduce"]
    parts = [f"# Report: {root}", "",
             f"{len(runs)} jobs, {sum(r.get('status') == 'ok' for _, r, _ in runs)} ok. "
             "Times in ms (training: warm-up steps excluded, slowest rank per step); GB/s = 1e9 bytes/s.", ""]
    if train:
        parts += ["## Training", "", markdown(*table(train, TRAINING)), ""]
    cost = accuracy_markdown(records, target_loss)
    if cost:
        parts += ["## Accuracy cost", "", cost, ""]
    bubbles = [(n, verdict(r)) for n, r, _ in runs]
    if any(text for _, text in bubbles):
        parts += ["## Pipeline bubble: measured against the schedule's", "", PIPELINE_INTRO, ""]
        parts += [f"- `{n}`: {text}" for n, text in bubbles if text] + [""]
    exposed = exposure_markdown(runs)
    if exposed:
        parts += ["## Exposed communication per collective", "", exposed, ""]
    memory = memory_markdown(records)
    if memory:
        parts += ["## Model state per rank: measured vs ZeRO paper", "",
                  "MiB (2^20 bytes) on the rank holding the most model state (params + grads + optimizer state, "
                  "the largest of after init, before and after the last step); the ZeRO paper's figure for the "
                  "job's stage (ddp_lab/arithmetic/zero_bytes.py) with fp32 AdamW's 4 + 4 + 8 bytes per parameter, "
                  "what ddp-lab keeps at every train.precision (autocast keeps fp32 parameters and gradients), as "
                  "`python -m ddp_lab.calculator` prints it; under bf16/fp16 compute the paper's mixed-precision "
                  "2 + 2 + 12 beside it. × paper = measured / paper: the bar is 1.05. Strategy state: what the "
                  "strategy keeps between steps beyond model state (buckets, error feedback, anchors); total: "
                  "model state + strategy state; live tensors: every tensor storage alive in the rank after the "
                  "last step (a census through the garbage collector). Peak gathered: the most parameter bytes "
                  "fsdp held gathered at once.", "",
                  memory, ""]
    if collective:
        parts += ["## Collectives", "", markdown(*table(collective, COLLECTIVES, keep_empty=True)), ""]
    failed = [(n, r) for n, r, _ in runs if r.get("status") != "ok"]
    if failed:
        parts += ["## Jobs that did not end ok", ""]
        parts += [f"- `{n}`: {r.get('status')}: {r.get('error')}" for n, r in failed] + [""]
    if step_model:
        parts += ["## Predicted vs measured", "", "The step-time model (docs/predict.md) replays each job's step; "
                  "measured = the job's p50 (ms).", "", step_model, ""]
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

def step_model_section(model_file, root, records: list[dict]) -> str:
    """`validate`'s table for this sweep; the predictions go into `records` (report.csv) too."""
    model = predict_fit.load(model_file)
    rows, notes = predict_validate.predict_records(model, root)
    by_job = {r["job"]: r for r in rows}
    for rec in records:
        row = by_job.get(rec["job"])
        rec.update(predicted_step_ms=row and row["predicted_step_ms"],
                   predicted_exposed_ms=row and row["predicted_exposed_ms"], prediction_error=row and row["error"])
    return predict_validate.markdown(rows, predict_validate.bucket_checks(model, rows), notes)


def make_report(root, collectives=None, out=None, quiet: bool = False, model=None, target_loss: float | None = None,
                reference: str | None = None, columns: list[str] | None = None) -> dict:
    """Everything `python -m ddp_lab.report` does; returns the paths written and the predictions."""
    root = Path(root)
    check_columns(columns)
    runs = load_runs(root)
    if not runs:
        raise FileNotFoundError(f"no job folders (with {RESULTS} or {CONFIG}) under {root}")
    records = job_records([(n, r) for n, r, _ in runs], target_loss, reference)  # ValueError: a bad --reference
    out = Path(out) if out else root
    out.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print_records(records, f"{root}", columns)
    bench = [r for _, r, _ in runs if task_of(r) == "allreduce"]
    if collectives:
        bench += [r for _, r, _ in load_runs(collectives) if task_of(r) == "allreduce"]
    predictions, notes = bucket_predictions(records, bench, asked=collectives is not None)
    step_model = step_model_section(model, root, records) if model else None
    pictures = {}
    for title, name, draw in (
        ("Step time by phase", "report_phases.png", lambda p: plots.plot_phases(records, p)),
        ("Bucket size", "report_buckets.png", lambda p: plots.plot_buckets(records, predictions, p)),
        ("Bandwidth against message size", "report_bandwidth.png", lambda p: plots.plot_bandwidth(records, p)),
        ("Timelines of profiled jobs", "report_timelines.png", lambda p: plots.plot_timelines(runs, p)),
        ("Pipeline schedules as they ran", "report_pipelines.png", lambda p: plots.plot_pipelines(runs, p)),
        ("Memory against step time: the sharding ladder", "report_ladder.png", lambda p: plots.plot_ladder(records, p)),
        ("Loss against wall time and step", "report_loss.png", lambda p: plots.plot_loss(runs, records, p)),
        ("Step time against link rate", "report_link_rate.png", lambda p: plots.plot_link_rate(records, p)),
        ("The experts' load per step", "report_expert_load.png", lambda p: plots.plot_expert_load(runs, p)),
    ):
        if draw(out / name):
            pictures[title] = out / name
    written = {"csv": write_csv(records, out / "report.csv"),
               "md": write_markdown(out / "report.md", root, runs, pictures, predictions, notes, records, step_model,
                                    target_loss),
               "png": list(pictures.values())}
    return {**written, "predictions": predictions, "notes": notes, "records": records}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_lab.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="a sweep folder (outputs/multirun/DATE/TIME), a folder of sweeps, "
                        "or one job folder")
    parser.add_argument("--collectives", help="a task=allreduce sweep to fit the cost model from")
    parser.add_argument("-o", "--out", help="where to write the report (default: DIR)")
    parser.add_argument("--model", help="a step-time model (python -m ddp_lab.predict fit): predicted beside measured")
    parser.add_argument("--target-loss", type=float, help="the loss 'time to target' is measured to "
                        f"(default: the reference's final loss + {TARGET_MARGIN:.0%})")
    parser.add_argument("--reference", metavar="JOB", help="the job (as the tables name it, e.g. 0 or "
                        "strategies/3) every comparable row's accuracy is held against (default: chosen per row)")
    parser.add_argument("--columns", help="the figures the terminal's tables show, comma-separated: groups "
                        "(speed, memory, accuracy, collectives) or column headers (default: all; report.md and "
                        "report.csv keep every column)")
    parser.add_argument("--publish", metavar="ENTITY/PROJECT", help="also upload the sweep's W&B runs (wandb sync) "
                        "and save its view (SWEEP/wandb_workspace.json) there; needs a login and wandb-workspaces")
    args = parser.parse_args(argv)
    if args.publish:
        from ddp_lab.analysis.wandb_view import PublishError, publish

        try:
            print(f"published: {publish(args.dir, args.publish)}")
        except PublishError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        report = make_report(args.dir, args.collectives, args.out, model=args.model, target_loss=args.target_loss,
                             reference=args.reference, columns=args.columns and args.columns.split(","))
    except (FileNotFoundError, ValueError, predict_fit.PredictError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in report["notes"]:
        print(f"note: {note}")
    for p in [report["md"], report["csv"], *report["png"]]:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
