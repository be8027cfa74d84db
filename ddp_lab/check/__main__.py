"""`python -m ddp_lab.check my_pkg.MyDDP`: does anyone's data-parallel wrapper train like one process?

    python -m ddp_lab.check my_pkg.ddp.MyDDP                      # 2 and 3 gloo ranks, every case
    python -m ddp_lab.check my_pkg.ddp.MyDDP --world-size 2,3,4 --cases plain,frozen
    python -m ddp_lab.check my_pkg.fsdp.FSDP --same-init --set compute_dtype=float16 \
        --layers linear=my_pkg.model.Linear,embedding=my_pkg.model.Embedding,norm=my_pkg.model.RMSNorm
    python -m ddp_lab.check ddp_lab.strategies.BucketedDDP --expect bucketed,overlap
    python -m ddp_lab.check my_pkg.tp.ColumnParallelLinear,my_pkg.tp.RowParallelLinear --tp 2,4   # tensor_parallel.py
    python -m ddp_lab.check my_pkg.pp.one_f_one_b --pp 2,4        # a pipeline schedule: pipeline.py

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
Every case and option: docs/check.md.
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
from ddp_lab.check.models import use_layers
from ddp_lab.check.observe import describe
from ddp_lab.check.parity import ATOL, RTOL, STEPS
from ddp_lab.check.pipeline import ATOL as PP_ATOL
from ddp_lab.check.pipeline import PP_CASES, locate_function, pp_verdict, run_pp_cases, seen_line, waiting
from ddp_lab.check.pipeline import RTOL as PP_RTOL
from ddp_lab.check.pipeline import STEPS as PP_STEPS
from ddp_lab.check.properties import PROPERTIES, WATCHED, claimed, describe_claim, judge, unjudged
from ddp_lab.check.ranks import RanksFailed, run_ranks
from ddp_lab.check.tensor_parallel import ATOL as TP_ATOL
from ddp_lab.check.tensor_parallel import RTOL as TP_RTOL
from ddp_lab.check.tensor_parallel import STEPS as TP_STEPS
from ddp_lab.check.tensor_parallel import TP_CASES, pair, run_tp_cases, tp_verdict
from ddp_lab.check.verdict import crash_line, verdict
from ddp_lab.config import key_values


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
    return (f"{target} against {reference} (atol {atol:g}, rtol {rtol:g}; torch {torch.__version__}, gloo on CPU"
            f"{read}):")


SECONDARY = ("Connection closed by peer", "remote worker crashing")  # gloo's words on a rank whose peer died


def _failure(exc: BaseException, timeout_s: float) -> tuple[str, str | None]:
    """What ended a set of ranks, in a line, and the failed rank's traceback where one raised: the first rank that
    raised of its own accord, before one that raised because its peer had died."""
    if isinstance(exc, RanksFailed) and exc.errors:
        first = min(range(len(exc.errors)), key=lambda i: any(s in exc.errors[i] for s in SECONDARY))
        return f"rank {exc.failed_ranks[first]} raised {crash_line(exc.errors[first])}", exc.errors[first]
    if isinstance(exc, RanksFailed):
        return (f"still running after {timeout_s:g} s: a rank waits for a collective the others never join, "
                "or for a gradient that never comes"), None
    return str(exc), None  # a rank killed by a signal or exiting without raising


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
    return {**results, **_run(target, world_size, kwargs, rest, timeout_s, log_dir, same_init, layers)}


# A compute dtype's tolerance (rtol 0), against a reference that rounds the same way: bit for bit at 2 ranks
# (the project's FSDP in fp16 and bf16), but at 3 the order of the fp32 sums moves AdamW's steps on tiny
# low-precision gradients by up to 5e-4 (fsdp, fp16, accumulation: measured). A sum in place of a mean still
# shows, in the sgd case (by 0.05).
LOW_ATOL = 1e-3


def is_fsdp(cls: type) -> bool:
    """An FSDP by its look: `gather_full_params()` (the 2026 course's), or FSDP in its name."""
    return callable(getattr(cls, "gather_full_params", None)) or "fsdp" in cls.__name__.lower()


def tolerances(kwargs: dict) -> tuple[float, float]:
    return (LOW_ATOL, 0.0) if compute_dtype(kwargs) is not None else (ATOL, RTOL)


def check(target: str, world_sizes: list[int], names: list[str], kwargs: dict, timeout_s: float,
          log_dir: str, same_init: bool = False, expect: set[str] = frozenset(), fsdp: bool = False,
          layers: dict[str, str] | None = None) -> list[tuple]:
    """(world size, run or property, "ok" / "FAIL" / "skip" / "seen", detail, a crashed rank's traceback or
    None) per run (a case, at each bucket size where the check chose them), claimed property and world size.
    `layers`: the user's own layer classes by kind, as dotted paths (`--layers`)."""
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
            line, trace = failure or (verdict(case, per_rank, atol, rtol, getattr(cls, "checks_optimizer", None)
                                              is not None, plain_passed), None)
            if case.name == "plain":
                plain_passed = (plain_passed is not False) and not line
            lines.append((world_size, run, "FAIL" if line else "ok",
                          f"{case.proves}: FAILED: {line}" if line else case.proves, trace))
        done = {run: per_rank for run, (per_rank, _) in results.items() if per_rank is not None}
        for prop, why in claims.items():
            if unjudged(done):
                lines.append((world_size, prop, "skip", unjudged(done), None))
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


def check_tp(target: str, degrees: list[int], names: list[str], timeout_s: float, log_dir: str) -> list[tuple]:
    """The tensor-parallel check (check/tensor_parallel.py) of a `COLUMN,ROW` pair: (tp, case, verdict, detail,
    a crashed rank's traceback or None) per case and degree, each case in a set of ranks of its own (a hang or a
    crash costs that case only)."""
    column, row = pair(target)
    lines = []
    for tp in degrees:
        for name in names:
            try:
                per_rank = run_ranks(run_tp_cases, tp, column, row, [name], timeout_s=timeout_s, log_dir=log_dir)
            except Exception as exc:  # a rank raised, died or hung
                failure, trace = _failure(exc, timeout_s)
                lines.append((tp, name, "FAIL", f"{TP_CASES[name].proves}: FAILED: {failure}", trace))
                continue
            verdict_, detail = tp_verdict([r[name] for r in per_rank], tp)
            shown = TP_CASES[name].proves if verdict_ == "ok" else \
                detail if verdict_ == "skip" else f"{TP_CASES[name].proves}: FAILED: {detail}"
            lines.append((tp, name, verdict_, shown, None))
    return lines


# autograd's words for backward through a graph already freed, or never kept (a detached output)
FREED = ("backward through the graph a second time", "does not require grad and does not have a grad_fn")


def check_pp(target: str, degrees: list[int], names: list[str], timeout_s: float, log_dir: str) -> list[tuple]:
    """The pipeline check (check/pipeline.py) of a schedule function: (pp, case, verdict, detail, a crashed rank's
    traceback or None) per case and degree, and a `seen` line per finished case; each case in a set of ranks of its
    own, so a hang costs that case only and is told by what each stage was waiting for."""
    locate_function(target)  # refused here, in one line, before any rank starts
    lines = []
    for pp in degrees:
        for name in names:
            proves = PP_CASES[name].proves
            with tempfile.TemporaryDirectory() as progress:
                try:
                    per_rank = run_ranks(run_pp_cases, pp, target, [name], progress, timeout_s=timeout_s,
                                         log_dir=log_dir)
                except Exception as exc:  # a rank raised, died or hung
                    failure, trace = _failure(exc, timeout_s)
                    if trace is None and isinstance(exc, RanksFailed):  # a hang: what every stage waited for
                        failure = f"still running after {timeout_s:g} s: {waiting(progress, name, pp)}"
                    if trace is not None and any(words in trace for words in FREED):
                        failure = ("a micro-batch's activations were freed before its backward (backward ran "
                                   "through a graph already freed, or never kept: keep each micro-batch's input and "
                                   f"output until its own backward): {failure}")
                    lines.append((pp, name, "FAIL", f"{proves}: FAILED: {failure}", trace))
                    continue
            results = [r[name] for r in per_rank]
            cause = pp_verdict(results)
            lines.append((pp, name, "FAIL" if cause else "ok", f"{proves}: FAILED: {cause}" if cause else proves, None))
            lines.append((pp, name, "seen", seen_line(results, pp), None))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_lab.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="the wrapper class, as a dotted path (my_pkg.ddp.MyDDP), or a tensor-parallel "
                                       "pair: the column- and the row-parallel layer, comma-separated")
    parser.add_argument("--world-size", default="2,3", help="gloo ranks, comma-separated (default: 2,3)")
    parser.add_argument("--cases", default=None, help=f"comma-separated, of {', '.join(CASES)} (a tensor-parallel "
                                                      f"pair: of {', '.join(TP_CASES)})")
    parser.add_argument("--tp", default=None, metavar="DEGREES",
                        help="a tensor-parallel pair's TP degrees, comma-separated (default 2,4)")
    parser.add_argument("--pp", default=None, metavar="DEGREES",
                        help="check a pipeline schedule function (the target) at these stage counts, comma-separated")
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
        if args.pp is not None:
            return _main_other(args, log_dir, ours, "pp")
        if tensor_parallel:
            return _main_other(args, log_dir, ours, "tp")
        world_sizes = _world_sizes(args.world_size)
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
    """The tensor-parallel check of a COLUMN,ROW pair (`axis` "tp") or the pipeline check of a schedule ("pp");
    ValueError for bad input."""
    if args.tp is not None and args.pp is not None:
        raise ValueError("--tp checks a pair of layers, --pp a schedule: one at a time")
    degrees = _world_sizes(getattr(args, axis) or "2,4", f"--{axis}")
    names = _case_names(args.cases, TP_CASES if axis == "tp" else PP_CASES)
    for flag, given in (("--set", args.set), ("--same-init", args.same_init), ("--expect", args.expect),
                        ("--layers", args.layers), ("--fsdp", args.fsdp)):
        if given:
            raise ValueError(f"{flag} is a data-parallel check's option; --{axis} takes --cases, --timeout, --logs "
                             "and --traceback")
    if axis == "tp":
        lines = check_tp(args.target, degrees, names, args.timeout, log_dir)
        print(f"{args.target} (column-parallel, row-parallel) against single-process training (atol {TP_ATOL:g}, "
              f"rtol {TP_RTOL:g}; torch {torch.__version__}, gloo on CPU; {TP_STEPS} SGD steps, every TP rank on the "
              "same batch):")
    else:
        lines = check_pp(args.target, degrees, names, args.timeout, log_dir)
        print(f"{args.target} (a pipeline schedule, stage r on rank r) against single-process training (atol "
              f"{PP_ATOL:g}, rtol {PP_RTOL:g}; torch {torch.__version__}, gloo on CPU; {PP_STEPS} SGD steps on the "
              "whole batch):")
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
    cases = sum(verdict_ != "seen" for _, _, verdict_, _, _ in lines)
    if not failed:
        _clear(log_dir, ours)
        print(f"every case passed ({cases})")
        return 0
    print(f"{failed} of {cases} failed; the ranks' output and tracebacks: {log_dir}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
