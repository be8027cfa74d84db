"""results.json: one per job, written atomically, in the format of the design notes.

Rank 0 writes it when a job succeeds; launch.py writes it when a job fails or is interrupted,
keeping the steps rank 0 had already streamed to steps.jsonl, so no measured step is lost.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

RESULTS = "results.json"
STEPS = "steps.jsonl"
CONFIG = "config.yaml"


def write_json_atomic(path: Path, data: dict) -> None:
    """Write to a temporary file in the same folder, then rename: readers never see half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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


def read_results(job_dir: Path) -> dict | None:
    path = Path(job_dir) / RESULTS
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def make_results(status: str, error: str | None, config: dict, env: dict, summary: dict, steps: list[dict]) -> dict:
    return {"status": status, "error": error, "config": config, "env": env, "summary": summary, "steps": steps}
