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
  phases.json          profile=true: every rank's forward, gradient-ready, comm and lap times per step
  wandb/               rank 0's W&B run (offline by default)
  attempts/K/          what an earlier attempt left, moved aside by `resume=`
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
PHASES = "phases.json"  # what `python -m ddp_lab.predict fit` reads (rank/profiler.py GradientClock)
WANDB = "wandb"  # the offline W&B run: `wandb sync JOB/wandb/offline-run-*`
ATTEMPTS = "attempts"
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
