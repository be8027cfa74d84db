"""`python launch.py resume=DIR`: re-run the jobs of a sweep (or a single run) that did not end ok.

Hydra cannot resume a multirun, but a sweep folder holds all that is needed: `multirun.yaml`
records the command line's overrides (`hydra.overrides.task`, split into points exactly as the
basic sweeper split them, so job N is point N) and the launcher's (`hydra.overrides.hydra`), and
each job folder N holds its results.json. launch.py turns `resume=DIR [more overrides]` into a
multirun of the same sweep folder with the `ddp_lab_resume` sweeper
(hydra_plugins/ddp_lab_resume), which sends only the jobs without an ok result to the configured
launcher (local, or SLURM through submitit) with their own job numbers, so each lands in its old
folder. Overrides given with `resume=` apply on top of every re-run job (say, a longer
`backend.timeout_s`). Only sweeps of Hydra's basic sweeper can be resumed.

A re-run job first moves its previous attempt's files into `attempts/K/` (see
`set_aside_previous_attempt`), so nothing is lost and the new attempt starts clean. A job that left a
complete checkpoint (`checkpoint.every`) goes on from its newest one (`checkpoint.load=` its own folder,
`own_checkpoint`) instead of from step 0; its checkpoints stay where they are.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from omegaconf import OmegaConf

from ddp_lab.jobdir import (
    ATTEMPTS,
    CONFIG,
    MULTIRUN,
    RESULTS,
    STEPS,
    WANDB,
    error_file,
    leaves_measured_steps,
    newest_checkpoint,
    node_file,
    rank_log,
    read_checkpoint,
    read_results,
    torchrun_log,
)
from ddp_lab.launcher.preflight import sweep_points as split_sweep

SWEEPER = "hydra/sweeper=ddp_lab_resume"


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(point: list[str], extra: list[str]) -> list[str]:
    """The point's overrides with `extra` replacing any that set the same key."""
    keys = {override_key(o) for o in extra}
    return [o for o in point if override_key(o) not in keys] + list(extra)


def sweep_points(sweep_dir: Path) -> list[list[str]]:
    """Every job's overrides, in job-number order, as the basic sweeper produced them."""
    task = OmegaConf.load(Path(sweep_dir) / MULTIRUN).hydra.overrides.task
    return split_sweep(list(task))


def is_ok(job_dir: Path) -> bool:
    return (read_results(job_dir) or {}).get("status") == "ok"


def own_checkpoint(job_dir: Path) -> list[str]:
    """`checkpoint.load=JOB` when the job left a complete checkpoint with measured steps still to run after it
    (its config.yaml's train.steps and warmup_steps), so that its re-run goes on from there; else nothing."""
    path = newest_checkpoint(job_dir) if (job_dir / CONFIG).exists() else None
    if path is None:
        return []
    train = OmegaConf.load(job_dir / CONFIG).train
    return [f"checkpoint.load={job_dir}"] if leaves_measured_steps(read_checkpoint(path), train) else []


def pending_jobs(sweep_dir: Path) -> list[tuple[int, list[str]]]:
    """(job number, overrides) of every job of the sweep without an ok result, each going on from its own
    newest checkpoint where it left one."""
    return [(num, merge_overrides(point, own_checkpoint(Path(sweep_dir) / str(num))))
            for num, point in enumerate(sweep_points(sweep_dir)) if not is_ok(Path(sweep_dir) / str(num))]


def recorded_hydra_overrides(hydra_yaml: Path, drop: tuple[str, ...]) -> list[str]:
    """The launcher and other hydra.* overrides the original command line gave, minus `drop` keys."""
    recorded = OmegaConf.load(hydra_yaml)
    recorded = recorded.hydra if "hydra" in recorded else recorded
    return [o for o in recorded.overrides.hydra if override_key(o) not in drop]


def resume_command_line(args: list[str]) -> tuple[list[str], list[list[str]]] | None:
    """launch.py's arguments for `resume=DIR ...`, and the points it will run; None without resume=.

    Returns ([], []) when every job of DIR already ended ok.
    """
    target = next((a.split("=", 1)[1] for a in args if a.startswith("resume=")), None)
    if target is None:
        return None
    folder = Path(target).expanduser().resolve()
    extra = [a for a in args if not a.startswith("resume=") and a not in ("-m", "--multirun")]
    if (folder / MULTIRUN).exists():
        hydra = recorded_hydra_overrides(folder / MULTIRUN, drop=("hydra.sweep.dir", "hydra/sweeper"))
        pending = pending_jobs(folder)
        if not pending:
            return [], []
        points = [hydra + merge_overrides(point, extra) for _, point in pending]
        return ["-m", SWEEPER, f"hydra.sweep.dir={folder}", *hydra, *extra], points
    recorded = folder / ".hydra" / "overrides.yaml"
    if not recorded.exists():
        raise FileNotFoundError(f"resume={target}: no {MULTIRUN} (a sweep) or .hydra/overrides.yaml (a run) there")
    if is_ok(folder):
        return [], []
    hydra = recorded_hydra_overrides(folder / ".hydra" / "hydra.yaml", drop=("hydra.run.dir",))
    own = merge_overrides(list(OmegaConf.load(recorded)), own_checkpoint(folder))
    point = hydra + merge_overrides(own, extra) + [f"hydra.run.dir={folder}"]
    return point, [point]


def set_aside_previous_attempt(job_dir: Path, node_rank: int, ranks: range) -> None:
    """Move what an earlier attempt of this job left, on this node, into attempts/K/.

    Each node moves only its own files (node 0: results, steps, W&B; every node: its torchrun log
    and its ranks' logs and errors), so nodes sharing one folder never move each other's fresh
    files. K counts this node's earlier attempts, so all nodes of one attempt agree on it.
    """
    job_dir = Path(job_dir)
    mine = [torchrun_log(node_rank)] + [rank_log(r) for r in ranks] + [error_file(r) for r in ranks]
    mine += [RESULTS, STEPS, WANDB] if node_rank == 0 else [node_file(node_rank)]
    found = [name for name in mine if (job_dir / name).exists()]
    if not found:
        return
    k = 1 + sum(1 for _ in job_dir.glob(f"{ATTEMPTS}/*/{torchrun_log(node_rank)}"))
    attempt = job_dir / ATTEMPTS / str(k)
    for name in found:
        (attempt / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(job_dir / name), str(attempt / name))
    if node_rank == 0 and (job_dir / CONFIG).exists():
        shutil.copy2(job_dir / CONFIG, attempt / CONFIG)
