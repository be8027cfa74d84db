"""ddp-lab's entry point: compose the config with Hydra, check it, run the job's ranks with torchrun.

    python launch.py                                   # the default experiment
    python launch.py strategy=naive,flat -m            # one job per strategy, one W&B group

One process per sweep job. It validates the composed config (a user's mistake is one line on
stderr and exit code 2, before any rank starts), saves the resolved config into the job's output
folder, starts torchrun as a child, maps its end to a status recorded in results.json, and returns
the job's headline metric (p50 step time in ms, or p50 latency for task=allreduce; lower is
better) for sweepers such as Optuna.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from ddp_lab.config import register_configs
from ddp_lab.job import run_job
from ddp_lab.preflight import check_command_line
from ddp_lab.results import CONFIG
from ddp_lab.tables import comparison_tables, job_name, print_table
from ddp_lab.validate import validate

register_configs()
# A unique folder per launch: two sweeps started in the same second must not share one.
OmegaConf.register_new_resolver("ddp_lab.pid", lambda: str(os.getpid()), use_cache=True)

EXIT_FAILED, EXIT_INTERRUPTED = 1, 130


def sweep_group(hc) -> str:
    """One W&B group per sweep (or per single run), named after its output folder."""
    root = hc.sweep.dir if hc.mode == RunMode.MULTIRUN else hc.run.dir
    return "_".join(Path(root).parts[-2:])


def headline(results: dict) -> float:
    summary = results.get("summary") or {}
    value = summary.get("step_time_ms") or summary.get("latency_ms") or {}
    return value.get("p50", float("nan")) if results.get("status") == "ok" else float("nan")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    validate(cfg)  # preflight checked it already; this guards other sweepers and launchers
    hc = HydraConfig.get()
    job_dir = Path(hc.runtime.output_dir)
    with open_dict(cfg):
        cfg.logger.group = cfg.logger.group or sweep_group(hc)
    OmegaConf.save(cfg, job_dir / CONFIG, resolve=True)
    results = run_job(cfg, job_dir)
    for table in comparison_tables([(job_name(job_dir), results)], f"{job_dir}"):
        print_table(table)
    if results["status"] != "ok":
        print(f"job {results['status']}: {results['error']}", file=sys.stderr)
    if results["status"] == "interrupted":
        sys.exit(EXIT_INTERRUPTED)
    if results["status"] != "ok" and hc.mode != RunMode.MULTIRUN:
        sys.exit(EXIT_FAILED)
    return headline(results)


if __name__ == "__main__":
    check_command_line(Path(__file__).parent / "conf", "config", sys.argv[1:])
    main()
