"""Hydra callback: one comparison table at the end of every sweep, and the sweep's exit code.

Registered in conf/config.yaml under hydra.callbacks. Every job appears, failed ones as failed rows
(training and task=allreduce jobs each get their table); if any job did not end ok the sweep exits
1, so scripts and CI notice. Plots and files: `python -m ddp_lab.report SWEEP_DIR`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ddp_lab.analysis.tables import print_tables
from ddp_lab.jobdir import read_results


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
        runs = [(job.name, read_results(job) or {"status": "missing", "config": {}}) for job in jobs]
        print_tables(runs, f"sweep {sweep_dir}")
        print(f"plots and report.md: python -m ddp_lab.report {sweep_dir}")
        failed = [name for name, res in runs if res.get("status") != "ok"]
        if failed:
            print(f"{len(failed)} of {len(runs)} jobs did not end ok: {', '.join(failed)}", file=sys.stderr)
            sys.exit(1)
