"""What a precision or compression choice costs in accuracy, beside what it saves: per training job,
from its results.json alone (offline, no torch).

- final loss: the last step's loss;
- the reference: the sweep's *exact* run of the same model (same `model` config): fp32 compute,
  fp32 on the wire, a strategy that delivers the exact average (no `rank` or `sync_every` knob, the
  marks of powersgd and local_sgd). The first such job in sweep order when there are several (exact
  strategies agree to fp32 rounding);
- loss gap: final loss minus the reference's (and as % of it);
- bytes on the wire per step (`comm_bytes_per_step`) and as a multiple of the reference's;
- time to target: the wall time (the sum of the steps' times, warm-up included: a run pays for
  them too) until the first step whose loss is at or below the target, and that step's number;
  the target is the reference's final loss + 5% (`TARGET_MARGIN`), or what `--target-loss` says.
  Raw per-step losses, not smoothed: a noisy run may touch the target early.
- grad error: the mean of `measure.grad_error` over the steps, where it was measured.
"""

from __future__ import annotations

TARGET_MARGIN = 0.05
LOSSY_KNOBS = ("rank", "sync_every")  # powersgd, local_sgd: their gradients are not the exact average


def _at(d, *keys):
    """d[k1][k2]... or None where a level is missing (results of failed jobs lack parts)."""
    for key in keys:
        d = d.get(key) if isinstance(d, dict) else None
    return d


def is_exact(results: dict) -> bool:
    """fp32 compute, fp32 gradients on the wire, the exact average: a reference for the others."""
    cfg = results.get("config") or {}
    strategy = cfg.get("strategy") or {}
    precision = str(_at(cfg, "train", "precision") or "fp32")
    comm_dtype = str(strategy.get("comm_dtype") or "fp32")
    return precision == "fp32" and comm_dtype == "fp32" and all(strategy.get(k) is None for k in LOSSY_KNOBS)


def losses(results: dict) -> list[tuple[int, float]]:
    return [(s["step"], s["loss"]) for s in results.get("steps") or [] if s.get("loss") is not None]


def elapsed_s(results: dict) -> list[tuple[float, float]]:
    """(wall seconds since the start, loss) at the end of each step."""
    out, total = [], 0.0
    for s in results.get("steps") or []:
        total += (s.get("step_time_ms") or 0.0) / 1e3
        if s.get("loss") is not None:
            out.append((total, s["loss"]))
    return out


def final_loss(results: dict) -> float | None:
    values = losses(results)
    return values[-1][1] if values else None


def time_to_target(results: dict, target: float) -> tuple[float | None, int | None]:
    """(seconds, step) at the first step whose loss is <= target; (None, None) if none reached it."""
    for (seconds, loss), (step, _) in zip(elapsed_s(results), losses(results)):
        if loss <= target:
            return seconds, step
    return None, None


def _model_key(results: dict) -> str:
    return repr(sorted(((_at(results, "config", "model") or {}).items())))


def accuracy(runs: list[tuple[str, dict]], target_loss: float | None = None) -> dict[str, dict]:
    """{job name: accuracy figures} for every training job (module docstring); failed jobs get
    what they recorded before failing."""
    train = [(name, res) for name, res in runs if (_at(res, "config", "task", "name") or "train") != "allreduce"]
    references: dict[str, tuple[str, dict]] = {}
    for name, res in train:
        if res.get("status") == "ok" and is_exact(res) and final_loss(res) is not None:
            references.setdefault(_model_key(res), (name, res))
    out = {}
    for name, res in train:
        reference = references.get(_model_key(res))
        ref_name, ref = reference if reference is not None else (None, None)
        ref_loss = final_loss(ref) if ref is not None else None
        target = target_loss if target_loss is not None else (
            ref_loss * (1 + TARGET_MARGIN) if ref_loss is not None else None)
        loss = final_loss(res)
        nbytes = _at(res, "summary", "comm_bytes_per_step")
        ref_bytes = _at(ref, "summary", "comm_bytes_per_step") if ref is not None else None
        seconds, step = time_to_target(res, target) if target is not None else (None, None)
        errors = [s["grad_error"] for s in res.get("steps") or [] if s.get("grad_error") is not None]
        out[name] = {
            "exact": is_exact(res), "reference_job": ref_name, "final_loss": loss, "reference_loss": ref_loss,
            "loss_gap": None if None in (loss, ref_loss) else loss - ref_loss,
            "loss_gap_pct": None if None in (loss, ref_loss) or not ref_loss else 100 * (loss - ref_loss) / ref_loss,
            "comm_bytes_per_step": nbytes,
            "bytes_vs_reference": None if not ref_bytes or nbytes is None else nbytes / ref_bytes,
            "target_loss": target, "time_to_target_s": seconds, "steps_to_target": step,
            "grad_error_mean": sum(errors) / len(errors) if errors else None,
        }
    return out
