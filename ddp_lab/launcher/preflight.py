"""Check a whole command line before anything runs: every sweep point composed and validated.

Hydra itself refuses unknown keys, wrong types and unknown options, but with a multi-line message
and, in a sweep, only when it reaches the bad point. Here every point of `a,b,c` sweeps is
composed up front with Hydra's compose API and the basic sweeper's own splitting, and the first
problem becomes one line on stderr and exit code 2, before any job or rank starts.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

from hydra import compose, initialize_config_dir

from ddp_lab.launcher.config_checks import ConfigError, validate
from ddp_lab.spec.strategies import not_a_knob
from ddp_lab.spec.strategy import StrategySpec

EXIT_BAD_INPUT = 2
_NOISE = ("full_key:", "reference_type", "object_type", "Config search path", "provider=", "path=",
          "To append to your config", "Set the environment variable HYDRA_FULL_ERROR", "Error in call to target")


def one_line(exc: BaseException) -> str:
    """Hydra's multi-line composition errors, cause included, as one line."""
    parts: list[str] = []
    for e in (exc, exc.__cause__):
        if e is None:
            continue
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        i = 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("Available options in"):
                options = []
                while i + 1 < len(lines) and not lines[i + 1].startswith(_NOISE) and ":" not in lines[i + 1]:
                    i += 1
                    options.append(lines[i])
                line = f"{line} {', '.join(options)}"
            if not line.startswith(_NOISE) and line not in parts:
                parts.append(line)
            i += 1
    return " ".join(p if p.endswith((".", ":")) else p + "." for p in parts).rstrip(".")


def strategy_knob_error(exc: BaseException) -> str | None:
    """Hydra's refusal of `strategy.KNOB=...` for a strategy whose spec has no such knob, worded as a
    strategy's knobs are (`not_a_knob`: the knobs it does have); None for any other error."""
    cause = exc.__cause__
    spec, key = getattr(cause, "object_type", None), getattr(cause, "key", None)
    if isinstance(spec, type) and issubclass(spec, StrategySpec) and key not in {f.name for f in fields(spec)}:
        return not_a_knob(spec, key)
    return None


RENAMED = {("checkpoint", "async"): "checkpoint.async is spelled checkpoint.async_save here: async is a Python "
                                    "keyword, which no structured config's field can be (docs/checkpoints.md)"}
"""Keys the design named that the config spells otherwise, and why: the one line a user who typed them reads."""


def renamed_key_error(exc: BaseException) -> str | None:
    """Hydra's refusal of a key in RENAMED, worded as RENAMED has it; None for any other error."""
    cause = exc.__cause__
    node = getattr(getattr(cause, "object_type", None), "__name__", "")
    for (group, key), why in RENAMED.items():
        if getattr(cause, "key", None) == key and node.lower() == f"{group}config":
            return why
    return None


def split_overrides(args: list[str]) -> tuple[list[str], bool]:
    """The overrides on a command line (flags dropped) and whether it asks for a multirun."""
    multirun = any(a in ("-m", "--multirun") for a in args)
    return [a for a in args if not a.startswith("-")], multirun


def sweep_points(overrides: list[str]) -> list[list[str]] | None:
    """One override list per job, as Hydra's basic sweeper will run them; None for other sweepers."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if any(o.lstrip("+~").startswith("hydra/sweeper=") for o in overrides):
        return None  # Optuna and friends choose their points as they go: each job checks its own
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def knobs_of_swept_groups(args: list[str]) -> list[str]:
    """`strategy=a,b strategy.knob=v -m` as `strategy.knob=choice(v)`: a sweep of one value.

    Hydra's multirun first composes one config from the overrides that sweep nothing, with each swept
    group at its default option (strategy=flat): a knob of the swept options that the default lacks
    (`strategy.shard_size` of hsdp) is then refused, in a multi-line error, before any job starts. A
    sweep of one value is left out of that composition and set in every job, as the user meant.
    Only in a multirun, only for a group the command line sweeps, only for a plain value."""
    overrides, multirun = split_overrides(args)
    if not multirun:
        return args
    swept = {o.split("=", 1)[0] for o in overrides
             if "=" in o and "." not in o.split("=", 1)[0] and _sweeps(o.split("=", 1)[1])}
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        group = key.split(".", 1)[0]
        plain = (sep and "." in key and not key.startswith(("+", "~", "hydra.")) and not _sweeps(value)
                 and re.fullmatch(r"[\w./\-+:*?@%~]+", value))  # what choice() takes as it is
        out.append(f"{key}=choice({value})" if plain and group in swept else arg)
    return out


def _sweeps(value: str) -> bool:
    """A sweep in Hydra's override grammar: a,b or a function (choice, range, glob, interval)."""
    return "," in value or value.startswith(("choice(", "range(", "glob(", "interval(", "tag(", "sort(", "shuffle("))


def check_command_line(config_dir: Path, config_name: str, args: list[str],
                       points: list[list[str]] | None = None) -> None:
    """Exit 2 with one line if any job of this command line would be refused.

    `points`: the jobs' overrides when the caller knows them better than the command line does
    (`resume=`, whose jobs come from the sweep folder).
    """
    if any(a in ("--help", "-h", "--hydra-help", "--info", "--cfg", "-c", "--shell-completion", "-sc")
           or a.startswith("--info") for a in args):
        return  # Hydra's own informational flags: nothing will run
    overrides, multirun = split_overrides(args)
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            if points is None:
                points = sweep_points(overrides) if multirun else [overrides]
            for n, point in enumerate(points or []):
                cfg = compose(config_name, overrides=point, return_hydra_config=True)
                if n == 0:  # one folder (a sweep's) for every point: before the checks that load torch
                    check_output_folder(cfg, multirun)
                try:
                    validate(cfg)
                except ConfigError as exc:
                    named = [o for o in point if not o.startswith("hydra.")]
                    where = f"{' '.join(named)}: " if multirun and len(points) > 1 else ""
                    raise ConfigError(f"{where}{exc}") from None
    except ConfigError as exc:
        _refuse(str(exc))
    except Exception as exc:  # Hydra's composition and override-parsing errors
        _refuse(strategy_knob_error(exc) or renamed_key_error(exc) or one_line(exc))


def check_output_folder(cfg, multirun: bool) -> None:
    """The job's output folder must be one this process can create (or already has), before Hydra
    tries and fails with a traceback."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    folder = Path(str(cfg.hydra.sweep.dir if multirun else cfg.hydra.run.dir)).absolute()
    existing = next(p for p in [folder, *folder.parents] if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}={folder}: {existing} is a file, not a folder")
    try:  # a real probe (permissions, read-only or special file systems), removed at once
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".ddp_lab_probe_"))
    except OSError as exc:
        raise ConfigError(f"{key}={folder}: cannot create the output folder in {existing}: "
                          f"{exc.strerror or exc}") from None


def _refuse(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)
