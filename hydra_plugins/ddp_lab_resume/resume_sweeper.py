"""A Hydra sweeper that re-runs the jobs of an existing sweep folder that did not end ok.

`python launch.py resume=DIR` selects it (ddp_lab/launcher/resume.py explains the design). It hands each
run of consecutive pending jobs to the configured launcher (basic, or submitit for SLURM) with
their original job numbers, so every job lands in its old folder and the end-of-sweep table covers
the whole sweep. It lives in the `hydra_plugins` package because Hydra only loads sweepers from there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper

from ddp_lab.launcher.resume import merge_overrides, pending_jobs


class ResumeSweeper(Sweeper):
    def __init__(self) -> None:
        self.config = self.launcher = self.hydra_context = None

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> Any:
        """`arguments`: overrides given with resume=, applied on top of each job's own."""
        returns, run = [], []
        for num, point in pending_jobs(Path(self.config.hydra.sweep.dir)) + [(None, None)]:
            if run and (num is None or num != run[-1][0] + 1):  # launch each run of consecutive jobs
                batch = [merge_overrides(p, arguments) for _, p in run]
                self.validate_batch_is_legal(batch)
                returns.append(self.launcher.launch(batch, initial_job_idx=run[0][0]))
                run = []
            if num is not None:
                run.append((num, point))
        return returns
