"""Rank 0's record of a run: steps.jsonl on disk, W&B, and the live progress bar.

Only rank 0 records (other ranks get `NullRecorder`), so a run is one W&B run whatever the world
size. Each step is appended to steps.jsonl as it ends, so a job that dies later still has every
step it measured; W&B gets the same record with the step as x-axis.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from ddp_lab.jobdir import STEPS
from ddp_lab.spec.figures import FIGURES, LOSS, STEP_TIME
from ddp_lab.spec.labels import flatten, run_name


def declare_metrics(run) -> None:
    """For W&B's default charts: every per-step figure is plotted against `step` (the train step, not
    W&B's own counter), and its run summary keeps what its row in spec/figures.py says."""
    run.define_metric("step")
    for figure in FIGURES:
        if figure.wandb:
            run.define_metric(figure.key, step_metric="step", summary=figure.wandb)
    run.define_metric("*", step_metric="step")


class NullRecorder:
    def start(self, total_steps: int) -> None: ...
    def log_once(self, data: dict) -> None: ...
    def step(self, record: dict) -> None: ...
    def finish(self, summary: dict | None, ok: bool) -> None: ...


class RunRecorder(NullRecorder):
    def __init__(self, cfg: DictConfig, job_dir: Path):
        self.steps_file = open(Path(job_dir) / STEPS, "a", buffering=1)  # line-buffered: a line per step
        self.console = Console(stderr=False)
        self.progress = None
        self.run = None
        if cfg.logger.name == "wandb" and cfg.logger.mode != "disabled":
            import wandb

            self.run = wandb.init(
                project=cfg.logger.project, entity=cfg.logger.entity, group=cfg.logger.group,
                name=run_name(cfg), job_type=cfg.task.name, dir=str(cfg.logger.get("dir") or job_dir),
                mode=cfg.logger.mode, notes=f"job folder: {Path(job_dir).absolute()}",
                config=OmegaConf.to_container(cfg, resolve=True),
                # No system-metrics sampler (it probes cloud metadata addresses), no git or code upload.
                settings=wandb.Settings(silent=True, console="off", x_disable_stats=True,
                                        x_disable_machine_info=True, x_disable_meta=True, disable_git=True,
                                        save_code=False, x_save_requirements=False),
            )
            declare_metrics(self.run)

    def start(self, total_steps: int) -> None:
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=self.console)
        self.task = self.progress.add_task("steps", total=total_steps, info="")
        self.progress.start()

    def log_once(self, data: dict) -> None:
        """Facts about the run that do not change per step (bucket plan, parameter count)."""
        if self.run is not None:
            self.run.summary.update(flatten(data))

    def step(self, record: dict) -> None:
        self.steps_file.write(json.dumps(record) + "\n")
        if self.run is not None:
            self.run.log(record, step=record["step"])
        if self.progress is not None:
            info = f"{record.get(STEP_TIME.key, 0):.0f} ms/step"
            if LOSS.key in record:
                info = f"loss {record[LOSS.key]:.3f}  " + info
            self.progress.update(self.task, advance=1, info=info)

    def finish(self, summary: dict | None, ok: bool) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.steps_file.close()
        if self.run is not None:
            if summary:
                self.run.summary.update(flatten(summary))
            self.run.finish(exit_code=0 if ok else 1)
