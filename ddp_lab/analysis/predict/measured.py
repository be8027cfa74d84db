"""Measured GPU compute for `scale`: a recorded table of measured steps, or one GPU job of the lab's.

`scale` prices a conf model's forward and backward from a measurement where one matches, and from the
system's peak x its assumed MFU only where none does; every table says which (`Compute.line`).

A row of the table (measured/gpu_compute.json, or any file given with `--compute-table`) is one
measured training step on one GPU with no gradient synchronization: the device as torch names it, the
torch version, the date, the model and its context, the batch per GPU, the precision and whether it was
compiled, and its times: `step_ms` always, `fwd_bwd_ms` and `optimizer_ms` where they were measured
apart (the lab's floor records both). `python -m ddp_lab.predict record SWEEP` appends the floor jobs
(`strategy=none`, one rank, on a GPU) of a sweep.

A row matches a system whose GPU its device names (systems.System.gpu), the same model (name, context
and parameter count), precision and compile. The same batch is *measured*. The MFU changes with the
batch (issue 52's rows: 0.08 at batch 8 and 0.24 at batch 32 for xl), so another batch is a guess, and
the output says which: *interpolated* between the measured batches around it (the compute linear in the
batch: a fixed cost and a cost per sequence), or beyond them *scaled* by tokens from the nearest (its MFU
kept). Forward and backward split the measured compute by their FLOPs (models/facts.py); a row
without the optimizer measured apart has it priced as scale prices it (memory-bound) and taken out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ddp_lab.analysis.predict.costs import PredictError
from ddp_lab.analysis.predict.systems import System
from ddp_lab.spec.figures import FWD_BWD, OPTIMIZER, STEP_TIME

TABLE = Path(__file__).parent / "measured" / "gpu_compute.json"
ROW_KEYS = ("device", "torch", "date", "model", "context", "params", "batch", "precision", "compile", "step_ms")


@dataclass(frozen=True)
class Compute:
    """One GPU's forward, backward and optimizer (ms) for scale, and where they come from: `kind` is measured,
    interpolated (between two measured batches), scaled (from the nearest measured batch) or assumed (the
    system's MFU); `line` says it in words."""

    kind: str
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    line: str


def load_table(path: str | Path | None = None) -> list[dict]:
    """The rows of a measured table (the lab's own by default), each checked for the keys a match needs."""
    path = Path(path) if path is not None else TABLE
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PredictError(f"cannot read the measured compute table {path}: {exc}") from None
    for i, row in enumerate(rows):
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            raise PredictError(f"{path}: row {i} lacks {', '.join(missing)}")
    return rows


def _matches(row: dict, system: System, cfg, n_params: int, precision: str, compiled: bool) -> bool:
    return (system.gpu.lower() in str(row["device"]).lower() and row["model"] == cfg.name
            and int(row["context"]) == int(cfg.context_length) and int(row["params"]) == n_params
            and row["precision"] == precision and bool(row["compile"]) == compiled)


def _source(row: dict) -> str:
    return f"{row['device']}, torch {row['torch']}, {row['date']}"


def compute(system: System, cfg, batch: int, fpt: dict, n_params: int, optimizer_priced_ms: float,
            precision: str = "bf16", compiled: bool = False, table: list[dict] | None = None) -> Compute:
    """The compute scale replays for `batch` sequences of `cfg` per GPU: the matching row of `table` at this
    batch, else interpolated between the matching batches around it, else the nearest one's scaled by tokens,
    and with no matching row the system's peak x MFU (module docstring).
    `fpt`: the model's FLOPs per token; `optimizer_priced_ms`: scale's own price of the optimizer."""
    tokens = batch * cfg.context_length
    rows = [r for r in (table or []) if _matches(r, system, cfg, n_params, precision, compiled)]
    mode = "compiled" if compiled else "eager"
    if not rows:
        ms_per_flop = 1e3 / (system.peak_flops * system.mfu)
        return Compute("assumed", fpt["forward"] * tokens * ms_per_flop, fpt["backward"] * tokens * ms_per_flop,
                       optimizer_priced_ms,
                       f"compute assumed: the GPU's peak x MFU {system.mfu:g} " + (
                           f"(no measured {cfg.name} step, {precision}, {mode}, on a {system.gpu} in the table)"
                           if table else "(no measured table: --mfu)"))

    def per_token(row: dict) -> tuple[float, float, bool]:
        """(forward and backward ms per token, optimizer ms, whether the optimizer was measured apart)."""
        apart = row.get(FWD_BWD.key) is not None and row.get(OPTIMIZER.key) is not None
        fwd_bwd, optimizer = (row[FWD_BWD.key], row[OPTIMIZER.key]) if apart else \
            (max(row["step_ms"] - optimizer_priced_ms, 0.0), optimizer_priced_ms)
        return fwd_bwd / (row["batch"] * row["context"]), optimizer, apart

    by_batch = {r["batch"]: r for r in sorted(rows, key=lambda r: str(r["date"]))}  # the newest of each batch
    below, above = max((b for b in by_batch if b <= batch), default=None), min((b for b in by_batch if b >= batch),
                                                                               default=None)
    if below is not None and above is not None and below != above:  # between two measured batches
        (lo, optimizer, apart), (hi, _, _) = per_token(by_batch[below]), per_token(by_batch[above])
        lo, hi = lo * below * cfg.context_length, hi * above * cfg.context_length  # their whole compute, ms
        ms_per_token = (lo + (batch - below) / (above - below) * (hi - lo)) / tokens
        kind, row = "interpolated", by_batch[above]
        how = (f"compute interpolated between measured batches {below} and {above} (linear in the batch) of "
               f"{cfg.name}, {precision}, {mode}, on {_source(row)} ")
    else:
        row = by_batch[below if below is not None else above]
        ms_per_token, optimizer, apart = per_token(row)
        kind = "measured" if row["batch"] == batch else "scaled"
        how = (f"compute measured: {cfg.name} at batch {batch}, {precision}, {mode}, on {_source(row)} "
               if kind == "measured" else
               f"compute scaled by tokens from the measured batch {row['batch']} of {cfg.name}, {precision}, {mode}, "
               f"on {_source(row)}, as if the MFU did not change with the batch (it does: a guess) ")
    fwd_bwd = ms_per_token * tokens
    forward = fwd_bwd * fpt["forward"] / fpt["step"]
    reached = fpt["step"] * tokens / (fwd_bwd * 1e-3) / system.peak_flops
    return Compute(kind, forward, fwd_bwd - forward, optimizer,
                   how + f"({row.get('source', 'the lab')}): forward and backward {fwd_bwd:.1f} ms, MFU "
                   f"{reached:.2f}; optimizer {optimizer:.1f} ms "
                   f"({'measured' if apart else 'priced, the measured step less it'})")


# --- recording the lab's own GPU jobs ------------------------------------------------------------------

def row_from_job(res: dict, date: str, where: str) -> dict | None:
    """A table row from a finished floor job (strategy=none) at one rank on a GPU; None for any other job."""
    cfg, env, summary = res.get("config") or {}, res.get("env") or {}, res.get("summary") or {}
    devices = env.get("devices") or []
    device = str(devices[0]).split(":", 1)[-1] if devices else "cpu"
    if (res.get("status") != "ok" or (cfg.get("strategy") or {}).get("name") != "none"
            or cfg.get("world_size") != 1 or device == "cpu" or (cfg.get("task") or {}).get("name") != "train"):
        return None
    p50 = {f.key: (summary.get(f.key) or {}).get("p50") for f in (STEP_TIME, FWD_BWD, OPTIMIZER)}
    params = (summary.get("memory") or {}).get("num_params")
    model, train = cfg.get("model") or {}, cfg.get("train") or {}
    if None in (*p50.values(), params):
        return None
    return {"device": device, "torch": env.get("torch"), "date": date, "model": model.get("name"),
            "context": model.get("context_length"), "params": params, "batch": train.get("batch_size"),
            "precision": train.get("precision", "fp32"), "compile": bool(train.get("compile", False)),
            "step_ms": round(p50[STEP_TIME.key], 3), FWD_BWD.key: round(p50[FWD_BWD.key], 3),
            OPTIMIZER.key: round(p50[OPTIMIZER.key], 3), "source": f"the lab's floor job {where}"}


def record(rows: list[dict], table_path: str | Path) -> tuple[int, int]:
    """Append `rows` to the table at `table_path` (created if absent), a row replacing one measured on the
    same device, torch, model, context, batch, precision and compile. Returns (added, replaced)."""
    path = Path(table_path)
    table = json.loads(path.read_text()) if path.exists() else {"rows": []}
    key = ("device", "torch", "model", "context", "params", "batch", "precision", "compile")
    added = replaced = 0
    for row in rows:
        same = [i for i, r in enumerate(table["rows"]) if all(r.get(k) == row[k] for k in key)]
        if same:
            table["rows"][same[0]] = row
            replaced += 1
        else:
            table["rows"].append(row)
            added += 1
    path.write_text(json.dumps(table, indent=1) + "\n")
    return added, replaced
