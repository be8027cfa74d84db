"""ddp-lab's entry point: compose the config with Hydra, check it, run the job's ranks with torchrun.

    python launch.py                                   # the default experiment
    python launch.py strategy=naive,flat -m            # one job per strategy, one W&B group
    python launch.py resume=outputs/multirun/DATE/TIME_PID   # re-run the jobs that did not end ok
    python launch.py strategy=naive,flat -m --dry-run  # check every job, start none

One process per sweep job. It validates the composed config (a user's mistake is one line on
stderr and exit code 2, before any rank starts), saves the resolved config into the job's output
folder, starts torchrun as a child, maps its end to a status recorded in results.json, and returns
the job's headline metric (p50 step time in ms, or p50 latency for task=allreduce; lower is
better) for sweepers such as Optuna.

Multi-node: one launch.py per node (by hand, or one per SLURM task under hydra/launcher=slurm),
each running torchrun for its own ranks. node_rank 0 writes results.json; the others write
node{N}.json with their own ranks' status.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from ddp_lab.analysis.end_of_run import job_ended
from ddp_lab.config import register_configs
from ddp_lab.jobdir import CONFIG, node_file, write_text_atomic
from ddp_lab.launcher.cluster import place_node
from ddp_lab.launcher.config_checks import ConfigError, validate
from ddp_lab.launcher.job import run_job
from ddp_lab.launcher.preflight import check_command_line, knobs_of_swept_groups
from ddp_lab.launcher.resume import resume_command_line
from ddp_lab.spec.figures import LATENCY, STEP_TIME

register_configs()
# A unique folder per launch: two sweeps started in the same second must not share one. Under a
# submitit launcher the job processes resolve hydra.sweep.dir again: Hydra carries this resolver
# (its Singleton state) and the launching process's cached value (load_sweep_config copies the
# cache) into them, so they find the launcher's folder, not one named after their own pid.
OmegaConf.register_new_resolver("ddp_lab.pid", lambda: str(os.getpid()), use_cache=True)

EXIT_FAILED, EXIT_INTERRUPTED = 1, 130
DRY_RUN = "--dry-run"  # check every job of the command line (Hydra's composition, every pre-launch check), start none


def sweep_group(hc) -> str:
    """One W&B group per sweep (or per single run), named after its output folder."""
    root = hc.sweep.dir if hc.mode == RunMode.MULTIRUN else hc.run.dir
    return "_".join(Path(root).parts[-2:])


def save_config(cfg: DictConfig, path: Path) -> None:
    """The job's config, the same bytes from every node (launcher.node_rank as node 0 has it), written
    atomically: the nodes of a multi-node job may share the folder, and ranks read this file."""
    job = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    job["launcher"]["node_rank"] = 0
    write_text_atomic(path, OmegaConf.to_yaml(job))


def under_submitit(hc) -> bool:
    """A submitit job process: its exit code would fail the whole sweep, so it only returns."""
    return "submitit" in str(hc.launcher.get("_target_", ""))


def headline(results: dict) -> float:
    summary = results.get("summary") or {}
    value = summary.get(STEP_TIME.key) or summary.get(LATENCY.key) or {}
    return value.get("p50", float("nan")) if results.get("status") == "ok" else float("nan")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    try:
        place_node(cfg)  # under SLURM: this node's rank and the rendezvous endpoint
        validate(cfg)  # preflight checked it already; this guards other sweepers and launchers
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    job_dir = Path(hc.runtime.output_dir)
    with open_dict(cfg):
        cfg.logger.group = cfg.logger.group or sweep_group(hc)
        wandb_root = hc.sweep.dir if hc.mode == RunMode.MULTIRUN else job_dir  # a sweep's runs share one folder
        cfg.logger.dir = cfg.logger.dir or str(Path(wandb_root).absolute())
    save_config(cfg, job_dir / CONFIG)
    results = run_job(cfg, job_dir)
    node = cfg.launcher.node_rank
    if node > 0:
        print(f"node {node} of {cfg.launcher.nnodes}: {results['status']} ({job_dir / node_file(node)}); "
              "results.json is written by node_rank 0")
    else:
        job_ended(job_dir, results)  # the table, and a profiled job's timeline picture
    if results["status"] != "ok":
        print(f"job {results['status']}: {results['error']}", file=sys.stderr)
    if under_submitit(hc):
        return headline(results)
    if results["status"] == "interrupted":
        sys.exit(EXIT_INTERRUPTED)  # a sweep stops here; `resume=` runs the rest
    if results["status"] != "ok" and hc.mode != RunMode.MULTIRUN:
        sys.exit(EXIT_FAILED)
    return headline(results)


def resume_or_exit(args: list[str]) -> tuple[list[str], list[list[str]] | None]:
    """`resume=DIR ...` becomes a multirun of DIR's unfinished jobs (ddp_lab/launcher/resume.py)."""
    try:
        resumed = resume_command_line(args)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    if resumed is None:
        return args, None
    if not resumed[0]:
        print("nothing to resume: every job there ended ok")
        sys.exit(0)
    return resumed


if __name__ == "__main__":
    # submitit's job processes unpickle the job function: ddp_lab must import there too.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                             os.environ.get("PYTHONPATH")]))
    dry_run = DRY_RUN in sys.argv[1:]  # every job checked, none started: tests/unit/test_docs_commands.py
    sys.argv[1:] = [a for a in sys.argv[1:] if a != DRY_RUN]
    sys.argv[1:], points = resume_or_exit(sys.argv[1:])
    sys.argv[1:] = knobs_of_swept_groups(sys.argv[1:])  # strategy=a,b strategy.knob=v -m: v in every job
    check_command_line(Path(__file__).parent / "conf", "config", sys.argv[1:], points)
    if dry_run:
        print(f"{DRY_RUN}: every job of this command line passes the checks; none started")
        sys.exit(0)
    main()
