"""What a rank runs (`task=`), one module each, and the registry of their names.

A task module has `run(cfg, device, recorder, job_dir) -> {"summary": ..., "steps": [...]}` (every
rank calls it inside the process group; rank 0's result becomes results.json). The summary of the
steps a failed job streamed is arithmetic/stats.py's `summarize_steps`, which the launcher calls.
"""

from ddp_lab.tasks import allreduce, train

TASKS = {"train": train, "allreduce": allreduce}
