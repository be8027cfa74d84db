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


TORCHFT = importlib.util.find_spec("torchft") is not None
NO_TORCHFT = 'torchft is not installed (pip install -e ".[dev,torchft]")'
requires_torchft = pytest.mark.skipif(not TORCHFT, reason=NO_TORCHFT)


def installed(name: str) -> bool:
    """Whether the optional extra strategy `name` needs (if any) is installed here."""
    if name.startswith("deepspeed_"):
        return DEEPSPEED
    return TORCHFT if name.endswith("_torchft") else True


def runnable_specs() -> list[str]:
    """Every registered strategy the every-strategy tests run here: DeepSpeed's only with DeepSpeed installed;
    never torchft's DiLoCo, which starts servers of its own and takes no checkpoints: its own tests
    (tests/parity/test_local_sgd_torchft.py, tests/e2e/test_torchft_launch.py) hold it against local_sgd; never
    the floor (`none`), which synchronizes nothing: tests/parity/test_floor.py holds what it promises."""
    return [name for name in SPECS if installed(name) and not name.endswith("_torchft") and SPECS[name].synchronizes]
