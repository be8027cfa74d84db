"""The suite runs on 2 workers (pytest-xdist, `-n auto --dist loadgroup` in pyproject.toml): a launch.py job
leaves a core idle while one process imports torch (the launcher, then torchrun), and waits for timeouts
leave both idle, so two tests at once take 13-14 minutes here where one at a time took 19.

A fixture shared by several tests must be built once, on one worker: each test is put in the group
(`xdist_group`) of what it shares, a session-scoped fixture of tests/e2e/conftest.py or its file's
module-scoped ones (a set of rank processes), joined where one test shares two. The tests of emulated
nodes share the machine's network namespaces, each asserting it leaves them as it found them: one worker
runs them, one after another.
"""

import os

import pytest

# No test talks to W&B's servers; offline runs are written where a test asks for them.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

ONE_AT_A_TIME = {"test_emulated_network.py"}
MAX_WORKERS = 4  # a test starts up to 6 processes (launch.py, torchrun, 4 ranks): more workers only contend


def pytest_xdist_auto_num_workers(config):
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


def _shared(item) -> set[str]:
    """What `item` shares with other tests: its session-scoped fixtures, and its file where it uses a
    module-scoped one."""
    module = item.nodeid.split("::")[0]
    out = {module} if item.path.name in ONE_AT_A_TIME else set()
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return out
    for name, defs in info.name2fixturedefs.items():
        scope = defs[-1].scope
        if scope == "session" and name not in ("tmp_path_factory", "worker_id", "testrun_uid"):
            out.add(name)
        elif scope == "module":
            out.add(module)
    return out


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    shared = {item.nodeid: _shared(item) for item in items}
    for names in shared.values():  # tests sharing two things join their groups
        first, *rest = sorted(names) or [None]
        for name in rest:
            parent[root(name)] = root(first)
    for item in items:
        if shared[item.nodeid]:
            item.add_marker(pytest.mark.xdist_group(root(min(shared[item.nodeid]))))
