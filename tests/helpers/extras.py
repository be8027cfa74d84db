"""Optional extras the suite runs when they are installed, and skips with the reason when not."""

import importlib.util

import pytest

from ddp_lab.spec.strategies import SPECS

DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NO_DEEPSPEED = 'DeepSpeed is not installed (pip install --no-build-isolation -e ".[dev,deepspeed]")'
requires_deepspeed = pytest.mark.skipif(not DEEPSPEED, reason=NO_DEEPSPEED)  # for tests; never on a fixture


def skip_without_deepspeed() -> None:
    """Inside a fixture: pytest refuses marks on fixtures (an error since pytest 9), so they skip from within."""
    if not DEEPSPEED:
        pytest.skip(NO_DEEPSPEED)


def runnable_specs() -> list[str]:
    """Every registered strategy this machine can run: DeepSpeed's only with DeepSpeed installed."""
    return [name for name in SPECS if DEEPSPEED or not name.startswith("deepspeed_")]
