"""`python -m ddp_lab.check my_pkg.MyDDP`: does anyone's data-parallel wrapper train like one process?

    python -m ddp_lab.check my_pkg.ddp.MyDDP                      # 2 and 3 gloo ranks, every case
    python -m ddp_lab.check my_pkg.ddp.MyDDP --world-size 2,3,4 --cases plain,frozen
    python -m ddp_lab.check ddp_lab.strategies.BucketedDDP --set bucket_mb=1

The wrapper keeps the contract of ddp_lab/strategies/base.py as far as a CS336-style DDP does:
`MyDDP(module, **kwargs)`, a forward, and `finish_gradient_synchronization()` called after
backward. `no_sync()` (for the accumulation case), a bucket size argument (`bucket_mb`,
`bucket_size_mb` or `bucket_cap_mb`: the bucket case), `make_optimizer` and `full_state_dict` are
used when it has them. One line per case and world size (cases.py says what each proves): ok,
FAIL with the first rank and parameter that differ, or skip with the reason. Each world size runs
its cases in one set of gloo ranks on this machine (CPU); when that fails or hangs past `--timeout`,
each case runs again alone, so the line names the case that broke. Exit status: 0 when no case
failed, 1 when one did, 2 for bad input.
"""

from __future__ import annotations

import argparse
import sys

from ddp_lab.check.cases import CASES, first_difference, locate, run_cases, skip_reason
from ddp_lab.check.parity import ATOL, RTOL
from ddp_lab.check.ranks import RanksFailed, run_ranks
from ddp_lab.config import key_values


def _world_sizes(text: str) -> list[int]:
    sizes = [int(s) for s in text.split(",") if s]
    if not sizes or min(sizes) < 2:
        raise ValueError(f"--world-size takes ranks >= 2, comma-separated, got {text!r}")
    return sizes


def _failure(exc: BaseException, timeout_s: float) -> str:
    """What ended a set of ranks, in a line."""
    if isinstance(exc, RanksFailed) and exc.errors:
        return "a rank raised " + exc.errors[0].strip().splitlines()[-1]
    if isinstance(exc, RanksFailed):
        return (f"still running after {timeout_s:g} s: a rank waits for a collective the others never join, "
                "or for a gradient that never comes")
    return str(exc)  # a rank killed by a signal or exiting without raising


def _run(target: str, world_size: int, kwargs: dict, names: list[str], timeout_s: float) -> dict:
    """Case -> (each rank's result, None), or (None, what ended the ranks) for every case of a set that failed."""
    if not names:
        return {}
    try:
        per_rank = run_ranks(run_cases, world_size, target, kwargs, names, timeout_s=timeout_s)
    except Exception as exc:  # a rank raised, died or hung
        return {n: (None, _failure(exc, timeout_s)) for n in names}
    return {n: ([r[n] for r in per_rank], None) for n in names}


def check(target: str, world_sizes: list[int], names: list[str], kwargs: dict, timeout_s: float) -> list[tuple]:
    """(world size, case, "ok" / "FAIL" / "skip", detail) per case and world size."""
    cls = locate(target)
    lines = []
    for world_size in world_sizes:
        runnable = [n for n in names if skip_reason(CASES[n], cls) is None]
        lines += [(world_size, n, "skip", skip_reason(CASES[n], cls)) for n in names if n not in runnable]
        results = _run(target, world_size, kwargs, runnable, timeout_s)
        if len(runnable) > 1 and any(failure for _, failure in results.values()):
            results = {}  # a rank raised, died or hung: each case alone says which broke
            for n in runnable:
                results.update(_run(target, world_size, kwargs, [n], timeout_s))
        for n in runnable:
            per_rank, failure = results[n]
            difference = failure or first_difference(CASES[n], per_rank, ATOL, RTOL)
            lines.append((world_size, n, "FAIL" if difference else "ok", difference or CASES[n].proves))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_lab.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="the wrapper class, as a dotted path (my_pkg.ddp.MyDDP)")
    parser.add_argument("--world-size", default="2,3", help="gloo ranks, comma-separated (default: 2,3)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a keyword argument for the wrapper's constructor (repeat for more)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a set of ranks may run (default 120)")
    args = parser.parse_args(argv)
    try:
        world_sizes = _world_sizes(args.world_size)
        names = [n for n in args.cases.split(",") if n]
        unknown = [n for n in names if n not in CASES]
        if unknown or not names:
            raise ValueError(f"unknown case {unknown[0] if unknown else ''!r}; cases: {', '.join(CASES)}")
        lines = check(args.target, world_sizes, names, key_values(args.set, "--set"), args.timeout)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.target} against single-process training (atol {ATOL:g}, rtol {RTOL:g}):")
    for world_size, name, verdict, detail in lines:
        print(f"  {verdict:<4}  {world_size} ranks  {name:<12}  {detail}")
    failed = sum(verdict == "FAIL" for *_, verdict, _ in lines)
    print(f"{failed} of {len(lines)} failed" if failed else f"every case passed ({len(lines)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
