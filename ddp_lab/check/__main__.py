"""`python -m ddp_lab.check my_pkg.MyDDP`: does anyone's data-parallel wrapper train like one process?

    python -m ddp_lab.check my_pkg.ddp.MyDDP                      # 2 and 3 gloo ranks, every case
    python -m ddp_lab.check my_pkg.ddp.MyDDP --world-size 2,3,4 --cases plain,frozen
    python -m ddp_lab.check ddp_lab.strategies.BucketedDDP --set bucket_mb=1

The wrapper keeps the contract of ddp_lab/strategies/base.py as far as a CS336-style DDP does:
`MyDDP(module, **kwargs)`, a forward, and `finish_gradient_synchronization()` called after backward.
`no_sync()` (for the accumulation case), a bucket size argument (`bucket_mb`, `bucket_size_mb` or
`bucket_cap_mb`: the bucket case; 25 MB, the course's, where the constructor requires one and `--set`
gives none), `make_optimizer` and `full_state_dict` are used when it has them. `--set` values are YAML,
and a torch dtype's name (`compute_dtype=bfloat16`) is that dtype. `--same-init`: every rank builds the
model from one seed (a wrapper that does not broadcast at start, as the 2026 course's FSDP may). One
line per case and world size (cases.py says what each proves): ok, FAIL with the cause and every
parameter that differs (verdict.py), or skip with the reason; then `seen` lines (the plain case, on
torch's layers, and own_classes, on the user's kind): the collectives per step, how many were issued
during backward, and what rank 0 holds of the parameters and of AdamW's state (observe.py: what parity
cannot see). Each world size runs its cases in one set of gloo ranks on this machine (CPU); when a rank
raises, dies or hangs past `--timeout`, the case it was in fails with the exception and the user's file
and line, and the cases after it run in one more set. The ranks' prints go to a log folder, kept and
named when a case failed (with each crashed rank's traceback; `--traceback` prints it). Exit status: 0
when no case failed, 1 when one did, 2 for bad input.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from ddp_lab.check.cases import CASES, finished, in_progress, locate, run_cases, skip_reason
from ddp_lab.check.observe import describe
from ddp_lab.check.parity import ATOL, RTOL, STEPS
from ddp_lab.check.ranks import RanksFailed, run_ranks
from ddp_lab.check.verdict import crash_line, verdict
from ddp_lab.config import key_values


def _world_sizes(text: str) -> list[int]:
    sizes = [int(s) for s in text.split(",") if s]
    if not sizes or min(sizes) < 2:
        raise ValueError(f"--world-size takes ranks >= 2, comma-separated, got {text!r}")
    return sizes


def _constructor_args(items: list[str]) -> dict:
    """`--set KEY=VALUE` as the wrapper's keyword arguments: YAML values, and a torch dtype's name
    (`float16`, `torch.bfloat16`) as that dtype, which a `compute_dtype=` argument expects."""
    out = key_values(items, "--set")
    for key, value in out.items():
        name = value.removeprefix("torch.") if isinstance(value, str) else None
        if name is not None and isinstance(getattr(torch, name, None), torch.dtype):
            out[key] = getattr(torch, name)
    return out


def _failure(exc: BaseException, timeout_s: float) -> tuple[str, str | None]:
    """What ended a set of ranks, in a line, and the failed rank's traceback where one raised."""
    if isinstance(exc, RanksFailed) and exc.errors:
        return f"rank {exc.failed_ranks[0]} raised {crash_line(exc.errors[0])}", exc.errors[0]
    if isinstance(exc, RanksFailed):
        return (f"still running after {timeout_s:g} s: a rank waits for a collective the others never join, "
                "or for a gradient that never comes"), None
    return str(exc), None  # a rank killed by a signal or exiting without raising


def _run(target: str, world_size: int, kwargs: dict, names: list[str], timeout_s: float, log_dir: str,
         same_init: bool = False) -> dict:
    """Case -> (each rank's result, None), or (None, (what ended the ranks, a traceback or None)). A set of
    ranks that fails part way keeps the cases it finished; the case it was in takes the failure, and the
    cases after it run in one more set: a crash costs one run more, not one per case."""
    if not names:
        return {}
    with tempfile.TemporaryDirectory() as progress:
        try:
            per_rank = run_ranks(run_cases, world_size, target, kwargs, names, progress, same_init,
                                 timeout_s=timeout_s, log_dir=log_dir)
            return {n: ([r[n] for r in per_rank], None) for n in names}
        except Exception as exc:  # a rank raised, died or hung
            failure = _failure(exc, timeout_s)
            done = finished(progress, names, world_size)
            rank = exc.failed_ranks[0] if isinstance(exc, RanksFailed) and exc.failed_ranks else \
                getattr(exc, "error_index", 0)  # torch's ProcessExitedException: the rank that died
            failed = in_progress(progress, rank)
    results = {n: (per_rank, None) for n, per_rank in done.items()}
    pending = [n for n in names if n not in done]
    if not pending:  # every case finished on every rank: what failed came after them (the ranks' teardown)
        return results
    failed = failed if failed in pending else pending[0]
    results[failed] = (None, failure)
    rest = [n for n in names[names.index(failed) + 1:] if n not in done]
    return {**results, **_run(target, world_size, kwargs, rest, timeout_s, log_dir, same_init)}


def check(target: str, world_sizes: list[int], names: list[str], kwargs: dict, timeout_s: float,
          log_dir: str, same_init: bool = False) -> list[tuple]:
    """(world size, case, "ok" / "FAIL" / "skip", detail, a crashed rank's traceback or None) per case and
    world size."""
    cls = locate(target)
    lines = []
    for world_size in world_sizes:
        runnable = [n for n in names if skip_reason(CASES[n], cls) is None]
        lines += [(world_size, n, "skip", skip_reason(CASES[n], cls), None) for n in names if n not in runnable]
        results = _run(target, world_size, kwargs, runnable, timeout_s, log_dir, same_init)
        for n in runnable:
            per_rank, failure = results[n]
            line, trace = failure or (verdict(CASES[n], per_rank, ATOL, RTOL), None)
            lines.append((world_size, n, "FAIL" if line else "ok",
                          f"{CASES[n].proves}: FAILED: {line}" if line else CASES[n].proves, trace))
        watched = [n for n in ("plain", "own_classes") if n in runnable and results[n][0] is not None] or \
            [n for n in runnable if results[n][0] is not None][:1]  # torch's layers and the user's kind
        lines += [(world_size, n, "seen", describe(results[n][0][0][3], STEPS), None) for n in watched]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_lab.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="the wrapper class, as a dotted path (my_pkg.ddp.MyDDP)")
    parser.add_argument("--world-size", default="2,3", help="gloo ranks, comma-separated (default: 2,3)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a keyword argument for the wrapper's constructor (repeat for more)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a set of ranks may run (default 120)")
    parser.add_argument("--traceback", action="store_true", help="print a crashed rank's whole traceback")
    parser.add_argument("--same-init", action="store_true",
                        help="every rank builds the model from one seed (a wrapper that does not broadcast at start)")
    args = parser.parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="ddp_lab_check_")
    try:
        world_sizes = _world_sizes(args.world_size)
        names = [n for n in args.cases.split(",") if n]
        unknown = [n for n in names if n not in CASES]
        if unknown or not names:
            raise ValueError(f"unknown case {unknown[0] if unknown else ''!r}; cases: {', '.join(CASES)}")
        lines = check(args.target, world_sizes, names, _constructor_args(args.set), args.timeout, log_dir,
                      args.same_init)
    except ValueError as exc:
        shutil.rmtree(log_dir, ignore_errors=True)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.target} against single-process training (atol {ATOL:g}, rtol {RTOL:g}; torch {torch.__version__}, "
          "gloo on CPU):")
    for world_size, name, verdict_, detail, trace in lines:
        print(f"  {verdict_:<4}  {world_size} ranks  {name:<12}  {detail}")
        if trace is not None:
            Path(log_dir, f"traceback-{world_size}ranks-{name}.txt").write_text(trace)
            if args.traceback:
                print(f"\n{world_size} ranks, {name}:\n{trace}", file=sys.stderr)
    failed = sum(verdict_ == "FAIL" for _, _, verdict_, _, _ in lines)
    cases = sum(verdict_ != "seen" for _, _, verdict_, _, _ in lines)
    if not failed:
        shutil.rmtree(log_dir, ignore_errors=True)
        print(f"every case passed ({cases})")
        return 0
    print(f"{failed} of {cases} failed; the ranks' output and tracebacks: {log_dir}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
