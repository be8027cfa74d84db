"""A search over the config space (tests/unit/test_config_search_*.py): every numeric key of every group's schema,
read from the schemas themselves (a key that lands is searched without a line here), given extreme and malformed
values, alone and in sampled pairs, through launch.py's own pre-launch path (`check_command_line`: Hydra's
composition, then every check). Each must be refused in one line with exit 2, or be accepted for a reason
written in ACCEPTED, within CHECK_S of the check's own time, leaving nothing in the output folder.

The clock starts after the imports every launch pays once (Hydra, torch): on this machine importing torch alone
takes about 1.5 s, so a check that needs torch is answered about 2.5 s after `python launch.py` starts, one
that does not in under 1 s (tests/e2e/test_bad_input.py holds the flagship refusal, a million-token context, to
2 s from the start).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import time
import typing
from pathlib import Path

import torch  # noqa: F401  (imported before the clock, as every launch imports it once)

from ddp_lab.config import DATA_SCHEMAS, NETWORK_SCHEMAS, Config, register_configs
from ddp_lab.launcher.preflight import check_command_line
from ddp_lab.spec.models import MODEL_SCHEMAS
from ddp_lab.spec.strategies import SPECS

CONF = Path(__file__).resolve().parents[2] / "conf"
register_configs()  # as launch.py does on import: the schema Hydra composes on
CHECK_S = 2.0
HUGE_INT, HUGE_FLOAT = 10**12, "1e12"
VALUES = {int: ["0", "-1", str(HUGE_INT), "1.5", "abc"], float: ["0", "-1", HUGE_FLOAT, "nan", "abc"]}
"""Per type: zero, negative, huge, malformed (a float where an int is meant, NaN where a float is), a string."""
MODEL_OPTIONS = {"transformer": "tiny", "toy_mlp": "toy", "ffn": "xxl_ffn",
                 "moe_transformer": "tiny_moe"}  # a conf/model option of each schema


def numeric_keys(cls, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted key, int or float) of every numeric field of a schema dataclass, its nested dataclasses' too
    (Optional ones included); fields typed Any (the groups) are the other schemas' to list."""
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        kinds = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
        if len(kinds) == 1 and kinds[0] in (int, float):
            out.append((prefix + f.name, kinds[0]))
        elif len(kinds) == 1 and dataclasses.is_dataclass(kinds[0]):
            out.extend(numeric_keys(kinds[0], f"{prefix}{f.name}."))
    return out


def run_cases(token_file: Path) -> list[tuple[list[str], str, type]]:
    """(base overrides, key, type) for the run's own schema and every model, data and network schema."""
    cases = [(["task=allreduce"] if key.startswith("task.") else [], key, kind) for key, kind in numeric_keys(Config)]
    for schema, option in MODEL_OPTIONS.items():
        cases += [([f"model={option}"], key, kind) for key, kind in numeric_keys(MODEL_SCHEMAS[schema], "model.")]
    for option, schema in DATA_SCHEMAS.items():
        base = [f"data={option}"] + ([f"data.path={token_file}"] if option == "tokens" else [])
        cases += [(base, key, kind) for key, kind in numeric_keys(schema, "data.")]
    for option, schema in NETWORK_SCHEMAS.items():
        cases += [([f"network={option}"], key, kind) for key, kind in numeric_keys(schema, "network.")]
    assert {schema for schema in MODEL_SCHEMAS} == set(MODEL_OPTIONS), "a model schema without an option to search"
    return cases


def strategy_cases() -> list[tuple[list[str], str, type]]:
    """(base overrides, key, type) for every strategy's numeric knobs."""
    return [([f"strategy={name}"], key, kind) for name, spec in SPECS.items()
            for key, kind in numeric_keys(spec, "strategy.")]


def answer(overrides: list[str], out_dir: Path) -> tuple[int, str, float]:
    """(exit code, stderr, seconds) of launch.py's pre-launch path on `overrides` (exit 0: accepted)."""
    args = [*overrides, "logger=none", f"hydra.run.dir={out_dir}"]
    err, code = io.StringIO(), 0
    # No collection of this worker's heap inside the clock (it runs between cases instead): in two full-suite runs
    # one case (task=allreduce task.time_budget_s=nan, 0.16 s alone) measured 2.03 s, at the same place both times.
    gc.disable()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stderr(err):
            try:
                check_command_line(CONF, "config", args)
            except SystemExit as exc:
                code = exc.code
        return code, err.getvalue(), time.perf_counter() - start
    finally:
        gc.enable()


def why_accepted(key: str, value: str) -> str | None:
    """The reason a value is valid, from ACCEPTED (a key's own entry, or its value's entry for every key)."""
    entry = ACCEPTED.get(key, {})
    return entry.get(value) or entry.get("*")


def assert_answered(overrides: list[str], key_values: list[tuple[str, str]], out_dir: Path) -> bool:
    """One command line: refused in one line naming the first key (and its value where the check sees it), or
    accepted where every value is in ACCEPTED; within CHECK_S; nothing left in the output folder. Returns whether
    it was accepted."""
    code, err, seconds = answer(overrides, out_dir)
    shown = " ".join(overrides)
    assert seconds <= CHECK_S, f"{shown}: answered in {seconds:.2f} s, more than {CHECK_S} s"
    assert not out_dir.exists() or not any(out_dir.iterdir()), f"{shown}: left {list(out_dir.iterdir())}"
    if code == 0:
        unexplained = [f"{k}={v}" for k, v in key_values if why_accepted(k, v) is None]
        assert not unexplained, f"{shown}: accepted, and ACCEPTED says of {unexplained} no reason it is valid"
        return True
    assert code == 2, f"{shown}: exit {code}, {err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{shown}: not one line:\n{err}"
    assert "Traceback" not in err
    return False


ACCEPTED: dict[str, dict[str, str]] = {
    # the run
    "task.iters": {str(HUGE_INT): "task.time_budget_s caps the timed iterations: a large count just means "
                                  "'as many as fit'"},
    "task.warmup_iters": {"0": "no warm-up: the first call is timed too"},
    "task.time_budget_s": {HUGE_FLOAT: "a budget that never binds: every task.iters iteration is timed"},
    "backend.timeout_s": {HUGE_FLOAT: "a collective may wait that long: timedelta and torch take it (a run with it "
                                      "and launcher.watchdog_s=1e12 ended ok here)"},
    "train.steps": {str(HUGE_INT): "a long job is a job: it runs until it is stopped, its results kept"},
    "train.warmup_steps": {"0": "every step measured"},
    "train.lr": {HUGE_FLOAT: "an experiment in divergence: the loss goes to inf or NaN, and the record says so"},
    "train.weight_decay": {"0": "no decay", HUGE_FLOAT: "as a huge lr: the weights are driven to 0, valid input"},
    "train.seed": {"0": "any seed in [0, 2^32 - world_size]"},
    "train.eval_every": {"0": "the validation loss after the last step only",
                         str(HUGE_INT): "as 0: no step before the last is due"},
    "train.eval_batches": {"0": "no validation loss"},
    "launcher.node_rank": {"0": "the first node"},
    "launcher.max_restarts": {"0": "no restart (the default)"},
    "launcher.watchdog_s": {"0": "no watchdog (the default)", HUGE_FLOAT: "a watchdog that never fires"},
    "fault.rank": {"0": "rank 0", "-1": "every rank"},
    "fault.node": {"0": "node 0"},
    "fault.step": {"0": "from the first step", str(HUGE_INT): "a fault after the run's last step never happens"},
    "fault.slowdown": {HUGE_FLOAT: "only with fault.kind=slow, and then a very slow rank, which the timeouts end"},
    "checkpoint.every": {"0": "no checkpoints", str(HUGE_INT): "the last step's checkpoint only"},
    "checkpoint.keep": {"0": "every checkpoint kept", str(HUGE_INT): "as 0: every checkpoint kept"},
    # models, data, network
    "model.rope_theta": {HUGE_FLOAT: "a very long wavelength: positions barely rotate, a valid model"},
    "model.shared_experts": {"0": "no shared expert: the routed ones only (tiny_moe's default)"},
    "model.balance_coeff": {"0": "a balancing loss of weight zero: as balance=none, a valid control",
                            HUGE_FLOAT: "a balancing loss that swamps the language model's: an experiment in "
                                        "balance at any cost, valid input"},
    "model.bias_rate": {"0": "the bias never moves: as balance=none, a valid control",
                        HUGE_FLOAT: "a bias that jumps by the rate each step: a study of how badly it oscillates"},
    "model.capacity_factor": {HUGE_FLOAT: "a capacity no expert fills: dropless in effect"},
    "data.val_fraction": {"0": "nothing held out: no validation loss"},
    "network.slow_step": {"0": "the link is slow from the start"},
    # strategies
    "strategy.bucket_mb": {HUGE_FLOAT: "one bucket for the whole model (as flat, overlapped with nothing)"},
    "strategy.rank": {str(HUGE_INT): "PowerSGD's rank is min(rank, rows, columns): matrices it would not shrink "
                                     "are sent whole"},
    "strategy.start_iter": {"0": "compress from the first step",
                            str(HUGE_INT): "never compress: bucketed with PowerSGD's bookkeeping"},
    "strategy.sync_every": {str(HUGE_INT): "never average: each rank trains alone, as strategy=none"},
    "strategy.delay": {"0": "no delay (the default)"},
    "strategy.mix": {"0": "the global fragment replaces the local one (the default)"},
    "strategy.error_decay": {"0": "SparseLoCo keeps no error feedback"},
    "strategy.decay": {"0": "DeMo's momentum keeps only the step's gradient"},
}
"""Every value the search finds valid, and why. A value accepted without an entry fails the search (a removed
refusal shows up here); an entry whose value is refused fails it too, so the table says what the checks do."""


def sample_pairs(cases: list[tuple[list[str], str, type]], count: int, seed: int) -> list[tuple[list[str], list]]:
    """`count` command lines of two values of two different keys, drawn with `seed`; pairs whose base overrides
    choose different options of one group (data=text and data=tokens) are not drawn, nor a model's key beside
    task=allreduce, which builds no model and reads none of its keys (whatever their value: the single keys' test
    holds them under task=train)."""
    import random

    draw = random.Random(seed)
    singles = [(base, key, value) for base, key, kind in cases for value in VALUES[kind]]
    pairs: list[tuple[list[str], list]] = []
    while len(pairs) < count:
        (base_a, key_a, value_a), (base_b, key_b, value_b) = draw.sample(singles, 2)
        groups = {}
        clash = key_a == key_b
        unread = {"task=allreduce"} & set(base_a + base_b) and any(k.startswith("model.") for k in (key_a, key_b))
        clash |= bool(unread)
        for item in base_a + base_b:
            group, _, option = item.partition("=")
            clash |= groups.setdefault(group, option) != option
        if not clash:
            overrides = list(dict.fromkeys(base_a + base_b)) + [f"{key_a}={value_a}", f"{key_b}={value_b}"]
            pairs.append((overrides, [(key_a, value_a), (key_b, value_b)]))
    return pairs
