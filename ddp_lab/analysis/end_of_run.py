"""What a user sees when a job or a sweep ends, read from the files the jobs wrote.

- `job_ended(job_dir, results)`, called by launch.py after each job: the job's table, for a pipeline job
  its bubble against its schedule's and the picture of its schedule as it ran (JOB/pipeline.png), and, for a
  profiled job (profile=true), its timeline picture (JOB/timeline.png, drawn from the ranks' traces:
  the ranks record, this draws) and the ranks' traces merged into one for Perfetto
  (JOB/trace_all_ranks.json).
- `SweepSummary`, a Hydra callback registered in conf/config.yaml under hydra.callbacks: one
  comparison table at the end of every sweep, and the sweep's exit code. Every job appears, failed
  ones as failed rows (training and task=allreduce jobs each get their table); if any job did not end
  ok the sweep exits 1, so scripts and CI notice. Plots and files: `python -m ddp_lab.report SWEEP_DIR`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ddp_lab.analysis.pipeline import pipeline_of, verdict
from ddp_lab.analysis.tables import print_tables
from ddp_lab.jobdir import MERGED_TRACE, PIPELINE, TIMELINE, read_results
from ddp_lab.spec.labels import run_name


def job_ended(job_dir: Path, results: dict) -> None:
    """The job's table; a pipeline job's bubble said against its schedule's, and its schedule as it ran
    (JOB/pipeline.png); a profiled job's timeline picture beside its traces."""
    print_tables([(job_dir.name, results)], f"{job_dir}")
    pipeline = pipeline_of(results)
    if pipeline is not None and results.get("status") == "ok":
        print(verdict(results) or "")
        from ddp_lab.analysis.pipeline import plot_schedules  # matplotlib: only for pipeline jobs

        print(f"the schedule as it ran: {plot_schedules({run_name(results['config']): pipeline}, job_dir / PIPELINE)}")
    overlap = (results.get("summary") or {}).get("trace_overlap")
    if overlap and overlap.get("traces"):
        from ddp_lab.analysis.timeline import plot_timeline  # matplotlib: ~0.4 s, only for profiled runs

        steps, name = overlap["profiled_steps"], run_name(results["config"])
        path = plot_timeline({name: [job_dir / t for t in overlap["traces"]]}, job_dir / TIMELINE,
                             title=f"Compute and communication per rank, profiled steps {steps[0]}-{steps[-1]}",
                             exposures={name: results["summary"].get("exposure")})
        print(f"timeline: {path}")
        from ddp_lab.arithmetic.traces import merge_traces

        merged = merge_traces([job_dir / t for t in overlap["traces"]], job_dir / MERGED_TRACE)
        print(f"every rank on one clock, for https://ui.perfetto.dev: {merged}")


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
        runs = [(job.name, read_results(job) or {"status": "missing", "config": {}}) for job in jobs]
        print_tables(runs, f"sweep {sweep_dir}")
        print(f"plots and report.md: python -m ddp_lab.report {sweep_dir}")
        if (sweep_dir / "wandb").is_dir():
            from ddp_lab.analysis.wandb_view import write_view_spec

            spec = write_view_spec(sweep_dir)
            print(f"W&B: every run under {sweep_dir / 'wandb'}: compare them offline with `wandb leet "
                  f"{sweep_dir / 'wandb'}`; the dashboard view {spec.name} is saved by "
                  f"`python -m ddp_lab.report {sweep_dir} --publish ENTITY/PROJECT`")
        failed = [name for name, res in runs if res.get("status") != "ok"]
        if failed:
            print(f"{len(failed)} of {len(runs)} jobs did not end ok: {', '.join(failed)}", file=sys.stderr)
            sys.exit(1)
