"""`python -m ddp_lab.check my_pkg.MyDDP`: does anyone's data-parallel wrapper train like one process?

    python -m ddp_lab.check my_pkg.ddp.MyDDP                      # 2 and 3 gloo ranks, every case
    python -m ddp_lab.check my_pkg.ddp.MyDDP --world-size 2,3,4 --cases plain,frozen
    python -m ddp_lab.check my_pkg.fsdp.FSDP --same-init --set compute_dtype=float16 \
        --layers linear=my_pkg.model.Linear,embedding=my_pkg.model.Embedding,norm=my_pkg.model.RMSNorm
    python -m ddp_lab.check ddp_lab.strategies.BucketedDDP --expect bucketed,overlap
    python -m ddp_lab.check my_pkg.tp.ColumnParallelLinear,my_pkg.tp.RowParallelLinear --tp 2,4   # tensor_parallel.py
    python -m ddp_lab.check my_pkg.pp.one_f_one_b --pp 2,4        # a pipeline schedule: pipeline.py
    python -m ddp_lab.check my_pkg.cp.ring_attention --cp 2,4     # a context-parallel attention: context.py
    python -m ddp_lab.check my_pkg.moe.MoE --ep 2,4               # an expert-parallel mixture of experts: experts.py

The wrapper keeps the contract of ddp_lab/strategies/base.py as far as a CS336-style DDP does: `MyDDP(module,
**kwargs)`, a forward, and `finish_gradient_synchronization()` called after backward. `no_sync()` (for the
accumulation case), `make_optimizer`, and `full_state_dict` or `gather_full_params` are used when it has them.
A wrapper with a bucket size argument (`bucket_mb`, `bucket_size_mb` or `bucket_cap_mb`) runs every case at 25
MB and at half the largest parameter unless `--set` gives one (cases.runs). `--set` values are YAML, and a
torch dtype's name (`compute_dtype=bfloat16`) is that dtype; a compute dtype below fp32 is checked against a
reference that rounds the same way. `--same-init`: every rank builds the model from one seed (a wrapper that
does not broadcast at start, as the 2026 course's FSDP may). One line per run and world size (cases.py says
what each proves): ok, FAIL with the cause and every parameter that differs (verdict.py), or skip with the
reason; then a line per claimed property (`--expect`, an FSDP's or a sharded optimizer's sharding:
properties.py), then `seen` lines (the plain case, on torch's layers, and own_classes, on the user's kind, at
each bucket size the check ran): the collectives per step, how many were issued during backward, what the
largest rank holds of the parameters and of AdamW's state and which layer classes were sharded (observe.py:
what parity cannot see). Each world size runs its cases in one set of gloo ranks on this machine (CPU); when a
rank raises, dies or hangs past `--timeout`, the case it was in fails with the exception and the user's file
and line, and the cases after it run in one more set. The ranks' prints go to a log folder (a new one in the
system's temporary directory, or `--logs DIR`), kept and named when a case failed (with each crashed rank's
traceback; `--traceback` prints it), removed when none did. Exit status: 0 when no case
failed, 1 when one did, 2 for bad input.
Every case and option: docs/check.md (tensor parallelism: check_tp.md; pipelines: check_pp.md; context parallelism:
check_cp.md; experts: check_ep.md).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from ddp_lab.check.cases import (
    BUCKET_SIZES,
    CASES,
    case_of,
    compute_dtype,
    finished,
    in_progress,
    layer_classes,
    locate,
    run_cases,
    runs,
    skip_reason,
)
from ddp_lab.check.context import CP_CASES, check_attention
from ddp_lab.check.context import header as attention_header
from ddp_lab.check.experts import EP_CASES, check_layer
from ddp_lab.check.experts import header as layer_header
from ddp_lab.check.models import use_layers
from ddp_lab.check.observe import describe
from ddp_lab.check.parity import ATOL, RTOL, STEPS
from ddp_lab.check.pipeline import PP_CASES, check_schedule
from ddp_lab.check.pipeline import header as schedule_header
from ddp_lab.check.properties import PROPERTIES, WATCHED, claimed, describe_claim, judge, unjudged
from ddp_lab.check.ranks import RanksFailed, run_ranks
from ddp_lab.check.tensor_parallel import TP_CASES, check_pair
from ddp_lab.check.tensor_parallel import header as pair_header
from ddp_lab.check.verdict import Tolerance, ended_by, verdict
from ddp_lab.config import key_values
from ddp_lab.piped import exit_code


def _world_sizes(text: str, flag: str = "--world-size") -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 2:
        raise ValueError(f"{flag} takes ranks >= 2, comma-separated, got {text!r}")
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


def _header(target: str, cls: type, kwargs: dict, fsdp: bool) -> str:
    """What is checked against what: the reference, the tolerance, torch's version, and how the wrapper was read."""
    atol, rtol = tolerances(kwargs)
    dtype = compute_dtype(kwargs)
    reference = (f"single-process training that computes in {str(dtype).removeprefix('torch.')} as it does"
                 if dtype else "single-process training")
    how = ["as an FSDP (its weights through gather_full_params() or full_state_dict())"] if fsdp else []
    if getattr(cls, "checks_optimizer", None) is not None:
        how.append("a sharded optimizer, under the project's plain DDP")
    if runs(cls, kwargs, ["plain"]) != ["plain"]:
        how.append("every case at " + " and at ".join(f"{v} (@{k})" for k, v in BUCKET_SIZES.items()))
    read = f"; read {'; '.join(how)}" if how else ""
    tolerance = (f"atol per parameter: twice how far one rounding of each step's gradients in "
                 f"{str(dtype).removeprefix('torch.')} moves it, at least {atol:g}, rtol {rtol:g}" if dtype
                 else f"atol {atol:g}, rtol {rtol:g}")
    return f"{target} against {reference} ({tolerance}; torch {torch.__version__}, gloo on CPU{read}):"


def _run(target: str, world_size: int, kwargs: dict, names: list[str], timeout_s: float, log_dir: str,
         same_init: bool = False, layers: dict | None = None) -> dict:
    """Case -> (each rank's result, None), or (None, (what ended the ranks, a traceback or None)). A set of
    ranks that fails part way keeps the cases it finished; the case it was in takes the failure, and the
    cases after it run in one more set: a crash costs one run more, not one per case."""
    if not names:
        return {}
    with tempfile.TemporaryDirectory() as progress:
        try:
            per_rank = run_ranks(run_cases, world_size, target, kwargs, names, progress, same_init, layers,
                                 timeout_s=timeout_s, log_dir=log_dir)
            return {n: ([r[n] for r in per_rank], None) for n in names}
        except Exception as exc:  # a rank raised, died or hung
            failure = ended_by(exc, timeout_s)
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
    return {**results, **_run(target, world_size, kwargs, rest, timeout_s, log_dir, same_init, layers)}


# A compute dtype's tolerance floor (rtol 0), against a reference that rounds the same way: bit for bit at 2 ranks
# (the project's FSDP in fp16 and bf16), but at 3 the order of the fp32 sums moves AdamW's steps on tiny
# low-precision gradients by up to 5e-4 (fsdp, fp16, accumulation: measured). Above the floor, each parameter's
# tolerance is derived from the dtype's rounding (verdict.Tolerance). A sum in place of a mean still shows, in the
# sgd case (by 0.05).
LOW_ATOL = 1e-3
AVERAGE_BLAMED = "every rank agrees, and all differ from one process: the average is wrong"


def is_fsdp(cls: type) -> bool:
    """An FSDP by its look: `gather_full_params()` (the 2026 course's), or FSDP in its name."""
    return callable(getattr(cls, "gather_full_params", None)) or "fsdp" in cls.__name__.lower()


def tolerances(kwargs: dict) -> tuple[float, float]:
    return (LOW_ATOL, 0.0) if compute_dtype(kwargs) is not None else (ATOL, RTOL)


def tolerance_of(kwargs: dict, per_rank: list):
    """A run's absolute tolerance: fp32's, or under a compute dtype one per parameter from the rounding reference's
    spread (rank 0's `seen["rounding"]`, cases.run_cases)."""
    dtype = compute_dtype(kwargs)
    if dtype is None:
        return ATOL
    return Tolerance(per_rank[0][3].get("rounding", {}), LOW_ATOL, str(dtype).removeprefix("torch."))


def without_dtype(kwargs: dict) -> dict:
    """The constructor arguments of a run's float32 twin: the same, with no compute dtype."""
    return {k: v for k, v in kwargs.items() if k != "compute_dtype"}


def check(target: str, world_sizes: list[int], names: list[str], kwargs: dict, timeout_s: float,
          log_dir: str, same_init: bool = False, expect: set[str] = frozenset(), fsdp: bool = False,
          layers: dict[str, str] | None = None) -> list[tuple]:
    """(world size, run or property, "ok" / "FAIL" / "skip" / "seen", detail, a crashed rank's traceback or
    None) per run (a case, at each bucket size where the check chose them), claimed property and world size.
    `layers`: the user's own layer classes by kind, as dotted paths (`--layers`)."""
    try:
        return _check(target, world_sizes, names, kwargs, timeout_s, log_dir, same_init, expect, fsdp, layers)
    finally:
        use_layers({})  # the models of this process back to torch's layers (a test calls check() in-process)


def _check(target: str, world_sizes: list[int], names: list[str], kwargs: dict, timeout_s: float,
           log_dir: str, same_init: bool, expect: set[str], fsdp: bool, layers: dict[str, str] | None) -> list[tuple]:
    use_layers(layer_classes(layers))  # here too: the verdicts read the models' parameter names
    cls = locate(target)
    atol, rtol = tolerances(kwargs)
    claims = claimed(expect, fsdp, getattr(cls, "checks_optimizer", None) is not None)
    lines = []
    for world_size in world_sizes:
        runnable = [n for n in names if skip_reason(CASES[n], cls) is None]
        lines += [(world_size, n, "skip", skip_reason(CASES[n], cls), None) for n in names if n not in runnable]
        planned = runs(cls, kwargs, runnable)
        results = _run(target, world_size, kwargs, planned, timeout_s, log_dir, same_init, layers)
        plain_passed = None  # the plain case's runs all passed (known before groups, which comes after it)
        for run in planned:
            per_rank, failure = results[run]
            case = case_of(run)[0]
            optimizer = getattr(cls, "checks_optimizer", None) is not None
            tolerance = None if failure else tolerance_of(kwargs, per_rank)
            line, trace = failure or (verdict(case, per_rank, tolerance, rtol, optimizer, plain_passed), None)
            if line and failure is None and AVERAGE_BLAMED in line and compute_dtype(kwargs) is not None:
                # the average blamed under a compute dtype: its float32 twin tells an average from a rounding
                twin, twin_failure = _run(target, world_size, without_dtype(kwargs), [run], timeout_s, log_dir,
                                          same_init, layers)[run]
                if twin_failure is None and verdict(case, twin, ATOL, RTOL, optimizer, plain_passed) is None:
                    line = verdict(case, per_rank, tolerance, rtol, optimizer, plain_passed, twin_passed=True)
            if case.name == "plain":
                plain_passed = (plain_passed is not False) and not line
            lines.append((world_size, run, "FAIL" if line else "ok",
                          f"{case.proves}: FAILED: {line}" if line else case.proves, trace))
        done = {run: per_rank for run, (per_rank, _) in results.items() if per_rank is not None}
        for prop, why in claims.items():
            if unjudged(done, prop):
                lines.append((world_size, prop, "skip", unjudged(done, prop), None))
                continue
            problem = judge(prop, world_size, done, fsdp)
            detail = describe_claim(prop, why, sizes_chosen=planned != runnable)
            lines.append((world_size, prop, "FAIL" if problem else "ok",
                          f"{detail}: FAILED: {problem}" if problem else detail, None))
        # every run a claim is read from (both bucket sizes: a claim seen at one shows in its line), else the first
        finished = [run for run in planned if run in done]
        watched = [run for run in finished if case_of(run)[0].name in WATCHED] or finished[:1]
        lines += [(world_size, run, "seen", describe(done[run], STEPS), None) for run in watched]
    return lines


LOGS = ("rank*.log", "spawn.log", "traceback-*.txt")  # what a check writes in its log folder


def _log_folder(given: str | None) -> tuple[str, bool]:
    """The folder the ranks' output goes to, and whether the check made it (so may remove it): `--logs DIR`
    (made if missing; a former check's logs there are replaced), else a new one in the system's temporary
    directory, never in the working directory."""
    if given is None:
        return tempfile.mkdtemp(prefix="ddp_lab_check_"), True
    folder = Path(given)
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    _clear(str(folder), False)
    return str(folder), made


def _clear(log_dir: str, ours: bool) -> None:
    """Remove what the check wrote in `log_dir`, and the folder itself where the check made it."""
    if ours:
        shutil.rmtree(log_dir, ignore_errors=True)
        return
    for pattern in LOGS:
        for path in Path(log_dir).glob(pattern):
            path.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_lab.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="the wrapper class, as a dotted path (my_pkg.ddp.MyDDP); a tensor-parallel "
                                       "pair, the column- and the row-parallel layer comma-separated; with --pp, a "
                                       "pipeline schedule function; with --cp, an attention function; with --ep, a "
                                       "mixture-of-experts layer class")
    parser.add_argument("--world-size", default=None, help="gloo ranks, comma-separated (default: 2,3)")
    parser.add_argument("--cases", default=None, help=f"comma-separated, of {', '.join(CASES)} (a tensor-parallel "
                                                      f"pair: of {', '.join(TP_CASES)}; a schedule: of "
                                                      f"{', '.join(PP_CASES)}; a mixture of experts: of "
                                                      f"{', '.join(EP_CASES)})")
    parser.add_argument("--tp", default=None, metavar="DEGREES",
                        help="a tensor-parallel pair's TP degrees, comma-separated (default 2,4)")
    parser.add_argument("--pp", default=None, metavar="DEGREES",
                        help="check a pipeline schedule function (the target) at these stage counts, comma-separated")
    parser.add_argument("--cp", default=None, metavar="DEGREES",
                        help="check a context-parallel attention (q, k, v, group, causal) -> out on these cp degrees, "
                             "comma-separated (docs/check_cp.md)")
    parser.add_argument("--ep", default=None, metavar="DEGREES",
                        help="check an expert-parallel mixture-of-experts layer (the target) on these ep degrees, "
                             "comma-separated (docs/check_ep.md)")
    parser.add_argument("--dtype", choices=("float64", "float32"), default=None,
                        help="with --cp or --ep: the dtype the attention or the layer runs in (default float64; "
                             "float32 for code that runs in no other)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a keyword argument for the wrapper's constructor (repeat for more)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a set of ranks may run (default 120)")
    parser.add_argument("--traceback", action="store_true", help="print a crashed rank's whole traceback")
    parser.add_argument("--same-init", action="store_true",
                        help="every rank builds the model from one seed (a wrapper that does not broadcast at start)")
    parser.add_argument("--expect", default="", metavar="PROPERTY,...",
                        help=f"what the wrapper claims beyond parity, of {', '.join(PROPERTIES)}: FAIL where not seen")
    parser.add_argument("--layers", default="", metavar="KIND=CLASS,...",
                        help="build the check's models of your own layer classes: linear=, embedding=, norm= dotted "
                             "paths (my_pkg.model.Linear), as the course's models are")
    parser.add_argument("--fsdp", action="store_true",
                        help="an FSDP (detected by gather_full_params() or its name): claims sharded parameters")
    parser.add_argument("--logs", metavar="DIR", default=None,
                        help="where the ranks' output and a failed run's tracebacks go, kept only when a case fails "
                             "(default: a new ddp_lab_check_* folder in the system's temporary directory)")
    args = parser.parse_args(argv)
    try:
        log_dir, ours = _log_folder(args.logs)
    except OSError as exc:
        print(f"error: --logs {args.logs}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    tensor_parallel = "," in args.target or args.tp is not None
    try:
        if args.ep is not None:
            return _main_other(args, log_dir, ours, "ep")
        if args.cp is not None:
            return _main_other(args, log_dir, ours, "cp")
        if args.pp is not None:
            return _main_other(args, log_dir, ours, "pp")
        if tensor_parallel:
            return _main_other(args, log_dir, ours, "tp")
        world_sizes = _world_sizes(args.world_size or "2,3")
        names = _case_names(args.cases, CASES)
        expect = {p for p in args.expect.split(",") if p}
        if expect - set(PROPERTIES):
            raise ValueError(f"--expect {sorted(expect - set(PROPERTIES))[0]!r} is no property: "
                             f"use {', '.join(PROPERTIES)}")
        kwargs = _constructor_args(args.set)
        layers = key_values([item for item in args.layers.split(",") if item], "--layers")
        layer_classes(layers)  # refused here, in one line, before any rank starts
        cls = locate(args.target)
        fsdp = args.fsdp or is_fsdp(cls)
        lines = check(args.target, world_sizes, names, kwargs, args.timeout, log_dir, args.same_init, expect, fsdp,
                      layers)
    except ValueError as exc:
        _clear(log_dir, ours)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(_header(args.target, cls, kwargs, fsdp))
    return _report(lines, log_dir, ours, args.traceback)


def _case_names(given: str | None, cases: dict) -> list[str]:
    names = [n for n in (given or ",".join(cases)).split(",") if n]
    unknown = [n for n in names if n not in cases]
    if unknown or not names:
        raise ValueError(f"unknown case {unknown[0] if unknown else ''!r}; cases: {', '.join(cases)}")
    return names


def _main_other(args, log_dir: str, ours: bool, axis: str) -> int:
    """The tensor-parallel check of a COLUMN,ROW pair (`axis` "tp"), the pipeline check of a schedule ("pp"), the
    context-parallel check of an attention function ("cp") or the expert-parallel check of a mixture-of-experts layer
    ("ep"); ValueError for bad input."""
    if sum(getattr(args, a) is not None for a in ("tp", "pp", "cp", "ep")) > 1:
        raise ValueError("--tp checks a pair of layers, --pp a schedule, --cp an attention, --ep a mixture of "
                         "experts: one at a time")
    degrees = _world_sizes(getattr(args, axis) or "2,4", f"--{axis}")
    names = _case_names(args.cases, {"tp": TP_CASES, "pp": PP_CASES, "cp": CP_CASES, "ep": EP_CASES}[axis])
    for flag, given in (("--world-size", args.world_size), ("--set", args.set), ("--same-init", args.same_init),
                        ("--expect", args.expect), ("--layers", args.layers), ("--fsdp", args.fsdp)):
        if given:
            raise ValueError(f"{flag} is a data-parallel check's option; --{axis} takes its degrees, --cases, "
                             "--timeout, --logs and --traceback")
    if args.dtype is not None and axis not in ("cp", "ep"):
        raise ValueError(f"--dtype is the context-parallel and expert-parallel checks' option; --{axis} takes its "
                         "degrees, --cases, --timeout, --logs and --traceback")
    if axis in ("cp", "ep"):  # the checks that take a dtype
        dtype = args.dtype or "float64"
        check_, header = (check_attention, attention_header) if axis == "cp" else (check_layer, layer_header)
        lines = check_(args.target, degrees, names, args.timeout, log_dir, dtype)
        print(header(args.target, dtype))
        return _report(lines, log_dir, ours, args.traceback, unit=axis)
    check_, header = (check_pair, pair_header) if axis == "tp" else (check_schedule, schedule_header)
    lines = check_(args.target, degrees, names, args.timeout, log_dir)
    print(header(args.target))
    return _report(lines, log_dir, ours, args.traceback, unit=axis)


def _report(lines: list[tuple], log_dir: str, ours: bool, traceback: bool, unit: str = "ranks") -> int:
    """Print the verdict lines and the summary; the exit status."""
    width = max(len(name) for _, name, *_ in lines)
    for world_size, name, verdict_, detail, trace in lines:
        where = f"{world_size} ranks" if unit == "ranks" else f"{unit} {world_size}"
        print(f"  {verdict_:<4}  {where}  {name:<{width}}  {detail}")
        if trace is not None:
            Path(log_dir, f"traceback-{world_size}{unit}-{name}.txt").write_text(trace)
            if traceback:
                print(f"\n{where}, {name}:\n{trace}", file=sys.stderr)
    failed = sum(verdict_ == "FAIL" for _, _, verdict_, _, _ in lines)
    passed = sum(verdict_ == "ok" for _, _, verdict_, _, _ in lines)
    skipped = sum(verdict_ == "skip" for _, _, verdict_, _, _ in lines)
    skips = f", skipped ({skipped})" if skipped else ""
    if not failed:
        _clear(log_dir, ours)
        print(f"every case passed ({passed}){skips}")
        return 0
    print(f"{failed} of {failed + passed} failed{skips}; the ranks' output and tracebacks: {log_dir}")
    return 1


if __name__ == "__main__":
    sys.exit(exit_code(main))
