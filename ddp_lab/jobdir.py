"""A job folder: the name of every file in it, atomic writes, and reading results and steps back.

One output folder per job, chosen once by launch.py and shared by every rank (and every node of a
multi-node job). Every module that reads or writes a file there takes its name from here.

```
JOB/
  config.yaml          the resolved config every rank reads (launch.py writes it)
  results.json         schema, status, error, config, env, summary, steps (rank 0 on success, else launch.py)
  steps.jsonl          rank 0's per-step records as they happened
  node{N}.json         a node other than node_rank 0: its own ranks' status
  model.pt             train.save_model=true: the final weights (rank 0)
  logs/rank{R}.log     each non-zero rank's output, a failing rank's traceback
  logs/torchrun-node{N}.log
  errors/rank{R}.txt   one line per rank that raised
  traces/rank{R}.json  profile=true: torch.profiler traces;  timeline.png: their picture
  trace_all_ranks.json profile=true: the ranks' traces merged on one clock, a process per rank (Perfetto)
  phases.json          profile=true: every rank's forward, gradient-ready, comm and lap times per step
  wandb/               rank 0's W&B run (offline by default)
  attempts/K/          what an earlier attempt left, moved aside by `resume=`
  restarts.jsonl       launcher.max_restarts: each restart of the workers, the step it resumed from and
                       what the failure cost
  checkpoints/step_N/  checkpoint.every: the state after step N-1 (torch.distributed.checkpoint's files,
                       complete ones only: a save in progress is step_N.partial/)
```
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ddp_lab.spec.figures import SCHEMA_VERSION

CONFIG = "config.yaml"
RESULTS = "results.json"
STEPS = "steps.jsonl"
MODEL = "model.pt"
LOGS = "logs"
ERRORS = "errors"
TRACES = "traces"
TIMELINE = "timeline.png"
PIPELINE = "pipeline.png"  # a pipeline job's schedule as it ran (analysis/pipeline.py)
MERGED_TRACE = "trace_all_ranks.json"
PHASES = "phases.json"  # what `python -m ddp_lab.predict fit` reads (rank/profiler.py GradientClock)
WANDB = "wandb"  # the offline W&B run: `wandb sync JOB/wandb/offline-run-*`
ATTEMPTS = "attempts"
CHECKPOINTS = "checkpoints"
RESTARTS = "restarts.jsonl"  # launcher.max_restarts: one line per restart, what the failure cost (rank/checkpoint.py)
CHECKPOINT_META = "checkpoint.json"  # what a checkpoint holds (rank/checkpoint.py): rank 0 writes it last, once
# every rank's files are written (DCP's metadata, or a strategy's own format), then renames the folder
MULTIRUN = "multirun.yaml"  # Hydra's record of a sweep's command line, in the sweep folder


# What a rank's line in errors/rank{R}.txt starts with when torchrun stopped it (it raised
# `Terminated` on SIGTERM), and when it ran out of memory: launcher/failures.py reads them.
TERMINATED = "Terminated"
OOM = "out of memory"


def node_file(node_rank: int) -> str:
    """What a node other than node_rank 0 records: its ranks' status (rank 0 writes results.json)."""
    return f"node{node_rank}.json"


def torchrun_log(node_rank: int) -> str:
    """torchrun's stderr: rendezvous messages and, when a rank fails, its failure summary."""
    return f"{LOGS}/torchrun-node{node_rank}.log"


def rank_log(rank: int) -> str:
    return f"{LOGS}/rank{rank}.log"


def error_file(rank: int) -> str:
    return f"{ERRORS}/rank{rank}.txt"


def trace_file(rank: int) -> str:
    return f"{TRACES}/rank{rank}.json"


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temporary file in the same folder, then rename: readers never see half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=1, default=str))


def read_steps(job_dir: Path) -> list[dict]:
    """The per-step records rank 0 streamed; a torn last line (a killed writer) is dropped."""
    steps = []
    path = Path(job_dir) / STEPS
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                steps.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return steps


class ResultsSchemaError(ValueError):
    """A results.json written by a newer ddp-lab than this one: refused, never misread."""


def read_results(job_dir: Path) -> dict | None:
    """results.json, or None where there is none (or half of one). A file without `schema` is version 1 (the
    same layout); a newer version than SCHEMA_VERSION raises ResultsSchemaError with one line to print."""
    path = Path(job_dir) / RESULTS
    if not path.exists():
        return None
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    version = results.get("schema", 1) if isinstance(results, dict) else None
    if not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
        raise ResultsSchemaError(f"{path}: results.json schema {version!r} is not one this ddp-lab reads "
                                 f"(1 to {SCHEMA_VERSION}): read it with the ddp-lab that wrote it")
    return results


def make_results(status: str, error: str | None, config: dict, env: dict, summary: dict, steps: list[dict]) -> dict:
    return {"schema": SCHEMA_VERSION, "status": status, "error": error, "config": config, "env": env,
            "summary": summary, "steps": steps}


def checkpoint_path(job_dir: Path | str, step: int) -> Path:
    """Where the checkpoint taken before step `step` (after `step` steps) lives."""
    return Path(job_dir) / CHECKPOINTS / f"step_{step}"


def complete_checkpoints(job_dir: Path | str) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint of a job, oldest first."""
    found = []
    for path in (Path(job_dir) / CHECKPOINTS).glob("step_*"):
        number = path.name.removeprefix("step_")
        if number.isdigit() and (path / CHECKPOINT_META).is_file():
            found.append((int(number), path))
    return sorted(found)


def newest_checkpoint(path: Path | str) -> Path | None:
    """`path` itself if it is a complete checkpoint, else the newest complete one of the job folder `path`."""
    path = Path(path)
    if (path / CHECKPOINT_META).is_file():
        return path
    found = complete_checkpoints(path)
    return found[-1][1] if found else None


CHECKPOINT_FORMAT = 1  # what rank/checkpoint.py writes; a newer one is refused


def read_checkpoint(path: Path | str) -> dict:
    """What a complete checkpoint holds (its checkpoint.json): the step to run next, the format, the strategy,
    world size and model that wrote it, each parameter's shape. ValueError for anything else."""
    try:
        return json.loads((Path(path) / CHECKPOINT_META).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a complete checkpoint ({exc.__class__.__name__}: {exc})") from None


def leaves_measured_steps(meta: dict, train) -> bool:
    """A run of `train` (its steps and warmup_steps) started from this checkpoint has a measured step left."""
    return train.steps - meta["step"] > train.warmup_steps


def own_format_problem(meta: dict, strategy: str, own: str | None, world_size: int) -> str | None:
    """Why a checkpoint (`read_checkpoint`) cannot load into `strategy` at `world_size` by format, or None: a
    checkpoint in a strategy's own format (`own_checkpoint` of its spec: DeepSpeed's) loads only into that
    strategy at its world size, and such a strategy takes no other checkpoint."""
    theirs = meta.get("own_format")
    if theirs is None and own is None:
        return None
    if theirs is None:
        return (f"strategy={strategy} loads only its own checkpoints ({own}'s format), and this one holds "
                f"{meta.get('strategy')}'s pieces")
    if (meta.get("strategy"), meta.get("world_size")) != (strategy, world_size):
        return (f"it is in {theirs}'s own format, written by strategy={meta.get('strategy')} at "
                f"{meta.get('world_size')} ranks, which loads only there")
    return None


def checkpoint_problem(meta: dict, shapes: dict) -> str | None:
    """Why a checkpoint (`read_checkpoint`) cannot load into a model of these parameter shapes, or None."""
    if meta.get("format", 0) > CHECKPOINT_FORMAT:
        return f"checkpoint format {meta.get('format')} is newer than this version's ({CHECKPOINT_FORMAT}): upgrade"
    theirs = meta.get("shapes", {})
    for name, shape in shapes.items():
        if name not in theirs:
            return f"it is of another model: it has no parameter {name!r}"
        if list(theirs[name]) != list(shape):
            return f"it is of another model: {name!r} is {list(theirs[name])} there, {list(shape)} here"
    extra = sorted(set(theirs) - set(shapes))
    return f"it is of another model: it has parameter {extra[0]!r}, this one not" if extra else None
