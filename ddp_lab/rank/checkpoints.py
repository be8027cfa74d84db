"""What the train loop asks of checkpoints (`checkpoint.every`, `.keep`, `.load`, `launcher.max_restarts`):
the step to start from, the save after a step when one is due and its figures, and what a restart cost.

torch.distributed.checkpoint is imported (rank/checkpoint.py, a second of every rank's start) only when a
checkpoint is saved or loaded; a run without checkpoints never imports it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from ddp_lab.jobdir import RESTARTS, STEPS, complete_checkpoints, newest_checkpoint, read_checkpoint
from ddp_lab.rank.memory import host_peak_bytes, host_peak_from_now
from ddp_lab.rank.process_group import restart_count
from ddp_lab.spec.figures import CHECKPOINT_BYTES, CHECKPOINT_MEMORY, CHECKPOINT_SAVE, CHECKPOINT_STAGED, STEP_TIME
from ddp_lab.spec.strategies import own_format

if TYPE_CHECKING:
    from ddp_lab.rank.checkpoint import Saving


def prune(job_dir: Path, keep: int) -> None:
    """Remove all but the newest `keep` complete checkpoints (0: keep every one). Rank 0 only."""
    if keep > 0:
        for _, path in complete_checkpoints(job_dir)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)


class Checkpoints:
    """What the train loop asks of checkpoints: the step to start from (a load), and after each step the
    save when one is due, as the step's figures. After torchrun restarted the workers
    (`launcher.max_restarts`) the job's own newest checkpoint is loaded; before it has one, or on a first
    attempt, `checkpoint.load`'s."""

    def __init__(self, cfg, job_dir: Path, about: dict, place=None):
        """`about`: the strategy, world size, mesh and model; `place`: where a rank's tensors lie in the whole
        parameters (`Parallelism.place`; rank/checkpoint.py's `as_is` by default)."""
        self.cfg, self.job_dir, self.about, self.place = cfg.checkpoint, Path(job_dir), about, place
        self.last = cfg.train.steps - 1
        self.loaded: dict | None = None
        self.saving: Saving | None = None  # the latest save, maybe still writing
        # DCP's writing thread runs its collectives on a group of its own, never interleaved with training's;
        # a strategy's own format (DeepSpeed's) is written blocking
        asynchronous = self.cfg.async_save and self.cfg.every and own_format(about.get("strategy")) is None
        self.background = dist.new_group(backend="gloo") if asynchronous else None

    def _requested(self) -> Path | None:
        if not self.cfg.load:
            return None
        path = newest_checkpoint(self.cfg.load)
        if path is None:
            from ddp_lab.rank.checkpoint import CheckpointError

            raise CheckpointError(f"checkpoint.load={self.cfg.load}: no complete checkpoint there")
        return path

    def start(self, model, optimizer, precision) -> int:
        """Load the checkpoint this run starts from, if any; the step to run first. After a restart, note
        what the failure cost (restarts.jsonl), a restart before the first checkpoint too (from step 0)."""
        restarted = restart_count() > 0
        path = (newest_checkpoint(self.job_dir) if restarted else None) or self._requested()
        step = 0
        if path is not None:
            from ddp_lab.rank.checkpoint import load

            began = time.perf_counter()
            step, rank_state = load(path, model, optimizer, precision, self.about, **self._placed())
            self.loaded = {"path": str(path), "step": step, "load_ms": (time.perf_counter() - began) * 1e3,
                           "rank_state": rank_state,
                           **{k: v for k, v in read_checkpoint(path).items() if k in ("strategy", "world_size")}}
        if restarted and dist.get_rank() == 0:
            note_restart(self.job_dir, step)
        return step

    def after_step(self, step: int, model, optimizer, precision) -> dict:
        """Save after `step` when due (every `checkpoint.every` steps and after the last): the figures of the
        loop's wait. With `checkpoint.async_save` every save but the last is written while training goes on:
        the loop waits for the copy it writes from, and for the save before it if that is still writing."""
        every = self.cfg.every
        if not every or ((step + 1) % every and step != self.last):
            return {}
        began, resident = time.perf_counter(), host_peak_from_now()
        if self.saving is not None:
            self.saving.wait()
        from ddp_lab.rank.checkpoint import save

        background = self.background if step != self.last else None
        self.saving = save(self.job_dir, step + 1, model, optimizer, precision, self.about, background,
                           **self._placed())
        figures = ({CHECKPOINT_STAGED.key: self.saving.staged_bytes} if background is not None
                   else {CHECKPOINT_BYTES.key: self.saving.wait()})
        if dist.get_rank() == 0:
            prune(self.job_dir, self.cfg.keep)  # the complete ones: an async save joins them once written
        figures[CHECKPOINT_SAVE.key] = (time.perf_counter() - began) * 1e3
        if resident is not None:
            figures[CHECKPOINT_MEMORY.key] = host_peak_bytes() - resident
        return figures


    def _placed(self) -> dict:
        return {} if self.place is None else {"place": self.place}


def note_restart(job_dir: Path, resumed: int) -> None:
    """After torchrun restarted the workers: append to JOB/restarts.jsonl what the failure cost, from what the
    failed attempt left in steps.jsonl: the steps it had run past the checkpoint (to be run again) and their
    time, and the time from its last recorded step to now (detecting the failure, restarting the workers,
    their rendezvous, the load)."""
    path = Path(job_dir) / STEPS
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    latest = {r["step"]: r for r in records}  # each step's record from the attempt that ran it last
    failed_after = max(latest, default=resumed - 1)
    again = [latest[s] for s in range(resumed, failed_after + 1) if s in latest]
    restart_s = time.time() - path.stat().st_mtime if path.exists() else None
    recomputed_s = sum(r.get(STEP_TIME.key, 0.0) for r in again) / 1e3
    note = {"restart": restart_count(), "resumed_from_step": resumed,
            "failed_after_step": failed_after, "steps_recomputed": len(again), "recomputed_s": recomputed_s,
            "restart_s": restart_s, "seconds_lost": recomputed_s + (restart_s or 0.0)}
    with open(Path(job_dir) / RESTARTS, "a") as f:
        f.write(json.dumps(note) + "\n")


def restarts(job_dir: Path) -> list[dict]:
    """Every restart of this job so far (restarts.jsonl), oldest first."""
    path = Path(job_dir) / RESTARTS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
