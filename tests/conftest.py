"""The suite runs on 2 workers (pytest-xdist, `-n auto --dist loadfile` in pyproject.toml): a launch.py job
leaves a core idle while one process imports torch (the launcher, then torchrun), and waits for timeouts leave
both idle. On this project's 2-core VM (2026-11-30) the whole suite took 19 min 55 s on 2 workers with 12% of the
cores idle, and 19 min 55 s on 3 with 0.2% idle: the cores are the limit, a third worker only contends. The e2e
tests' launch.py jobs (about 65) spend most of their CPU starting processes: a 2-rank job of 3 steps costs 13.6 s of
CPU, each rank 3.9 s importing torch, torch._dynamo (which every optimizer imports on first use) and the lab.

What tests share must be built once, on one worker: a file's module-scoped fixtures (a set of rank
processes) keep its tests together (one file, one unit of work), and the files reading one of
tests/e2e/conftest.py's session sweeps form one unit (UNITS; a test outside its sweep's unit fails the
collection, naming the files to put together). The emulated-node tests share the machine's network namespaces, each
asserting it leaves them as it found them: one file, one worker. xdist's own `--dist loadgroup` would do
this from marks, but it stopped grouping on pytest 9.2 (pytest-dev/pytest-xdist#1386): units are
computed here, by file.
"""

import os
import signal

import pytest

# A suite started in the background (`pytest tests &` in a script, nohup, some CI runners) inherits SIGINT
# ignored, and so would every launch.py it starts, which then never sees the Ctrl-C a test sends it (seen: the
# interrupt tests waited for ever). Python's own handler again here; children get SIGINT's default with it.
signal.signal(signal.SIGINT, signal.default_int_handler)

# ATen's AVX2 kernels on every x86 machine, in this process and every rank and launch it starts (they inherit the
# environment; set before any test imports torch): the parity tolerances were set on AVX2, and on an AVX-512
# machine two cases land outside them (the two-level ring at 2 ranks: 3.6e-5 on lm_head against 1e-5 + 1e-4 x
# |w|; the course's FSDP in fp16 at 3 ranks: 1.3e-3 against 1e-3), both equal to the reference again with AVX2.
# Their tolerances are to be derived from the kernels' rounding, not widened to fit: until then the suite pins
# the kernels. `ATEN_CPU_CAPABILITY=default pytest tests` (or avx512) runs it on other kernels.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
# No test talks to W&B's servers; offline runs are written where a test asks for them.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

MAX_WORKERS = 4  # a test starts up to 6 processes (launch.py, torchrun, 4 ranks): more workers only contend
UNITS = {  # the files reading a session sweep of tests/e2e/conftest.py (named after it): one unit each
    "ladder": ["test_zero1_launch", "test_zero2_launch", "test_fsdp_launch", "test_checkpoint_launch"],  # and hsdp's
    "crash_sweep": ["test_failures", "test_report_launch"],
    "examples_sweep": ["test_examples", "test_predict_launch"],
    "sweeps_started_together": ["test_launch", "test_scale"],
}
UNIT = {f"tests/e2e/{name}.py": unit for unit, names in UNITS.items() for name in names}
IGNORED_SESSION_FIXTURES = {"tmp_path_factory", "worker_id", "testrun_uid"}  # pytest's and xdist's own


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file's in UNITS, or its file."""
    path = nodeid.split("::")[0]
    return UNIT.get(path, path)


def pytest_xdist_auto_num_workers(config):
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        """loadfile with the files of each of UNITS together, in the order collected (the long e2e ones first)."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # by test count the many short parity tests would go first
    return FileGroups(config, log)


LONG_UNIT_FILES = ("tests/unit/test_plan.py", "tests/unit/test_published.py", "tests/unit/test_config_search_run.py",
                   "tests/unit/test_config_search_strategy.py")
"""Unit-test files that each keep a worker busy for half a minute or more (test_plan.py 31 s alone): started right after
the e2e files, not where the alphabet puts them, near the end, where one would run on alone while the other worker has
nothing left (the longest first: the suite's tail is its shortest units)."""


def pytest_collection_modifyitems(config, items):
    """The e2e files and LONG_UNIT_FILES first, the rest in the order collected; and every test reading a session
    sweep is in one unit with the others that read it, or collection fails."""
    items.sort(key=lambda item: not (item.nodeid.startswith("tests/e2e/")
                                     or item.nodeid.split("::")[0] in LONG_UNIT_FILES))
    where: dict[str, set[str]] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        for name, defs in (info.name2fixturedefs.items() if info else ()):
            if defs[-1].scope == "session" and name not in IGNORED_SESSION_FIXTURES:
                where.setdefault(name, set()).add(item.nodeid.split("::")[0])
    for name, files in where.items():
        if len({unit_of(f) for f in files}) > 1:
            raise pytest.UsageError(f"tests/conftest.py: session fixture {name!r} is read by {sorted(files)}: put "
                                    "them in one of UNITS, so that one worker builds it once")
