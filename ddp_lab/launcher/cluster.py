"""Where this node sits in a multi-node job when a scheduler, not the user, places the nodes.

Under `hydra/launcher=slurm` each sweep point is one SLURM job of `launcher.nnodes` nodes with one
task per node, and submitit runs launch.py's job function once in every task. Each task must start
torchrun with its own node rank and the same rendezvous endpoint; SLURM says both: SLURM_NODEID
(with one task per node, the task's rank) and the first host of SLURM_JOB_NODELIST. submitit's
JobEnvironment reads them, and reads their SUBMITIT_LOCAL_* twins under `hydra/launcher=slurm_local`,
where each task plays one node on this machine: the same code path, testable without a cluster.
"""

from __future__ import annotations

import os
import zlib

from omegaconf import DictConfig, open_dict

from ddp_lab.launcher.config_checks import ConfigError


def rendezvous_port(job_id: str) -> int:
    """Every node of a job derives the same port from the job id; two jobs rarely share one."""
    return 20000 + zlib.crc32(job_id.encode()) % 20000


def scheduler_environment():
    """submitit's view of this task (SLURM or local), or None outside a submitit job."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    import submitit

    return submitit.JobEnvironment()


def place_node(cfg: DictConfig) -> None:
    """Fill launcher.node_rank and rdzv_endpoint from the scheduler when nnodes > 1 and no endpoint
    was given; otherwise leave the config as the user wrote it."""
    launcher = cfg.launcher
    if launcher.nnodes == 1 or launcher.rdzv_endpoint:
        return
    env = scheduler_environment()
    if env is None:
        return  # validate() then asks for launcher.rdzv_endpoint
    if env.num_tasks != launcher.nnodes or (env.num_nodes > 1 and env.num_nodes != env.num_tasks):
        raise ConfigError(
            f"launcher.nnodes={launcher.nnodes} but this job has {env.num_tasks} task(s) on {env.num_nodes} node(s): "
            "run one task per node (hydra.launcher.nodes=${launcher.nnodes}, hydra.launcher.tasks_per_node=1)")
    host = "127.0.0.1" if env.cluster == "local" else env.hostnames[0]
    with open_dict(cfg):
        launcher.node_rank = env.global_rank
        launcher.rdzv_endpoint = f"{host}:{rendezvous_port(str(env.job_id))}"
