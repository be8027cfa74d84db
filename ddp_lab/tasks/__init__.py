"""What a rank runs (`task=`), one module each, and the registry of their names.

A task module has `run(cfg, device, recorder, job_dir) -> {"summary": ..., "steps": [...]}` (every
rank calls it inside the process group; rank 0's result becomes results.json) and
`summarize(steps, cfg) -> summary`, which the launcher uses for the steps a failed job streamed.
"""

from ddp_lab.tasks import allreduce, train

TASKS = {"train": train, "allreduce": allreduce}
