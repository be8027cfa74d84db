"""What a precision or compression choice costs in accuracy, beside what it saves: per training job,
from its results.json alone (offline, no torch).

- the loss: the validation loss where the job measured it at two or more steps (`train.eval_every`),
  else the per-step training loss (`loss_kind` says which); final loss: its last value. The
  validation loss after the last step is its own column (`final_val_loss`) either way;
- the reference (`reference_job`, and `reference_why`: how it was chosen): an *exact* run (fp32
  compute, fp32 on the wire, a strategy that delivers the exact average: no `rank` or `sync_every`
  knob, the marks of powersgd and local_sgd) that differs from the row only in what is compared:
  the strategy and its knobs, and `train.precision` (`comparable`: same model, data, world size,
  training settings and fault). Among those, the row's own strategy with its knobs (a bucket sweep's row is
  its own reference), else its own strategy, else the only configuration that fits (jobs alike in
  all that shapes training count as one: the first is taken). Where several configurations fit and
  none is the row's own strategy, or none fits, the row has no reference and says why; `--reference
  JOB` (python -m ddp_lab.report) names it instead, for every row it is comparable with;
- loss gap: final loss minus the reference's (and as % of it);
- bytes on the wire per step (`comm_bytes_per_step`) and as a multiple of the reference's;
- time to target: the wall time (the sum of the steps' times, warm-up included: a run pays for
  them too; validation is not timed) until the first step whose loss is at or below the target,
  and that step's number;
  the target is the reference's final loss + 5% (`TARGET_MARGIN`), or what `--target-loss` says.
  Raw per-step losses, not smoothed: a noisy run may touch the target early.
- grad error: the mean of `measure.grad_error` over the steps, where it was measured.
"""

from __future__ import annotations

from ddp_lab.spec.figures import GRAD_ERROR, LOSS, STEP_TIME, VAL_LOSS
from ddp_lab.spec.strategies import SPECS

TARGET_MARGIN = 0.05
LOSSY_KNOBS = ("rank", "sync_every")  # powersgd, local_sgd: their gradients are not the exact average
# train keys a row and its reference may differ in: compared (precision), or not training (what is
# measured or saved)
NOT_TRAINING = ("precision", "warmup_steps", "save_model")


def _at(d, *keys):
    """d[k1][k2]... or None where a level is missing (results of failed jobs lack parts)."""
    for key in keys:
        d = d.get(key) if isinstance(d, dict) else None
    return d


def is_exact(results: dict) -> bool:
    """fp32 compute, fp32 gradients on the wire, the exact average: a reference for the others (the floor,
    `strategy=none`, only at one rank: at more, each rank trains alone)."""
    cfg = results.get("config") or {}
    strategy = cfg.get("strategy") or {}
    precision = str(_at(cfg, "train", "precision") or "fp32")
    comm_dtype = str(strategy.get("comm_dtype") or "fp32")
    spec = SPECS.get(str(strategy.get("name")))
    alone = spec is not None and not spec.synchronizes and (cfg.get("world_size") or 1) > 1
    return (precision == "fp32" and comm_dtype == "fp32" and not alone
            and all(strategy.get(k) is None for k in LOSSY_KNOBS))


def loss_kind(results: dict) -> str:
    """"validation" where the job measured its held-out loss at two or more steps, else "training"."""
    held_out = [s for s in results.get("steps") or [] if s.get(VAL_LOSS.key) is not None]
    return "validation" if len(held_out) >= 2 else "training"


def _loss_key(results: dict) -> str:
    return VAL_LOSS.key if loss_kind(results) == "validation" else LOSS.key


def losses(results: dict) -> list[tuple[int, float]]:
    """(step, loss) of the job's loss curve (`loss_kind`)."""
    key = _loss_key(results)
    return [(s["step"], s[key]) for s in results.get("steps") or [] if s.get(key) is not None]


def elapsed_s(results: dict) -> list[tuple[float, float]]:
    """(wall seconds since the start, loss) at the end of each step of the loss curve."""
    out, total, key = [], 0.0, _loss_key(results)
    for s in results.get("steps") or []:
        total += (s.get(STEP_TIME.key) or 0.0) / 1e3
        if s.get(key) is not None:
            out.append((total, s[key]))
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


def comparable(results: dict) -> dict:
    """What a row and its reference must share: everything that shapes training but the strategy and
    train.precision (the knobs being compared)."""
    cfg = results.get("config") or {}
    train = {k: v for k, v in (cfg.get("train") or {}).items() if k not in NOT_TRAINING}
    return {"model": cfg.get("model"), "data": cfg.get("data"), "world_size": cfg.get("world_size"),
            "train": train, "fault": cfg.get("fault")}


def _differences(a: dict, b: dict) -> list[str]:
    """The comparable keys (dotted, one level into train) in which two jobs differ."""
    ka, kb = comparable(a), comparable(b)
    out = []
    for key in ka:
        if key == "train":
            out += [f"train.{k}" for k in sorted(set(ka[key]) | set(kb[key])) if ka[key].get(k) != kb[key].get(k)]
        elif ka[key] != kb[key]:
            out.append(key)
    return out


def _configuration(results: dict) -> str:
    """The strategy and its knobs but those whose difference is compared (comm_dtype, the lossy ones)."""
    strategy = dict(_at(results, "config", "strategy") or {})
    return repr(sorted((k, v) for k, v in strategy.items() if k not in ("comm_dtype", *LOSSY_KNOBS)))


def choose_reference(res: dict, jobs: dict[str, dict], forced: str | None = None) -> tuple[str | None, str]:
    """(reference job or None, how it was chosen or why there is none) for one row among `jobs` (name:
    results, in sweep order; module docstring)."""
    if forced is not None:
        differs = _differences(res, jobs[forced])
        return (None, f"differs from --reference {forced} in {', '.join(differs)}") if differs else \
            (forced, "--reference")
    fits = [(n, r) for n, r in jobs.items() if r.get("status") == "ok" and is_exact(r) and final_loss(r) is not None
            and not _differences(res, r)]
    name = _at(res, "config", "strategy", "name")
    own = [(n, r) for n, r in fits if _at(r, "config", "strategy", "name") == name]
    mine = _configuration(res)
    for pool, why in (([c for c in own if _configuration(c[1]) == mine], "exact run of the same strategy and knobs"),
                      (own, "exact run of the same strategy"), (fits, "the one exact configuration like it")):
        if len({_configuration(r) for _, r in pool}) == 1:  # one configuration: take the first
            return pool[0][0], why
    if fits:
        return None, (f"{len({_configuration(r) for _, r in fits})} exact configurations fit "
                      f"({', '.join(n for n, _ in fits)}): name one with --reference JOB")
    return None, "no exact run with the same model, world size and training settings"


def accuracy(runs: list[tuple[str, dict]], target_loss: float | None = None,
             reference: str | None = None) -> dict[str, dict]:
    """{job name: accuracy figures} for every training job (module docstring); failed jobs get
    what they recorded before failing. `reference`: a job name every comparable row is held against;
    ValueError when it is not a finished training job of `runs` with losses."""
    train = [(name, res) for name, res in runs if (_at(res, "config", "task", "name") or "train") != "allreduce"]
    by_name = dict(train)
    if reference is not None:
        named = by_name.get(reference)
        if named is None or named.get("status") != "ok" or final_loss(named) is None:
            jobs = ", ".join(n for n, _ in train[:6]) + (" ..." if len(train) > 6 else "")
            raise ValueError(f"--reference {reference}: not a finished training job with losses in this sweep "
                             f"(its jobs: {jobs})")
    out = {}
    for name, res in train:
        ref_name, why = choose_reference(res, by_name, reference)
        ref = by_name.get(ref_name)
        ref_loss = final_loss(ref) if ref is not None else None
        target = target_loss if target_loss is not None else (
            ref_loss * (1 + TARGET_MARGIN) if ref_loss is not None else None)
        loss = final_loss(res)
        nbytes = _at(res, "summary", "comm_bytes_per_step")
        ref_bytes = _at(ref, "summary", "comm_bytes_per_step") if ref is not None else None
        seconds, step = time_to_target(res, target) if target is not None else (None, None)
        errors = [s[GRAD_ERROR.key] for s in res.get("steps") or [] if s.get(GRAD_ERROR.key) is not None]
        out[name] = {
            "exact": is_exact(res), "reference_job": ref_name, "reference_why": why, "final_loss": loss,
            "loss_kind": loss_kind(res), "final_val_loss": _at(res, "summary", "final_val_loss"),
            "reference_loss": ref_loss,
            "loss_gap": None if None in (loss, ref_loss) else loss - ref_loss,
            "loss_gap_pct": None if None in (loss, ref_loss) or not ref_loss else 100 * (loss - ref_loss) / ref_loss,
            "comm_bytes_per_step": nbytes,
            "bytes_vs_reference": None if not ref_bytes or nbytes is None else nbytes / ref_bytes,
            "target_loss": target, "time_to_target_s": seconds, "steps_to_target": step,
            "grad_error_mean": sum(errors) / len(errors) if errors else None,
        }
    return out
