"""docs/compose.md is what `python -m ddp_lab.spec --compose` prints, and every cell of it is held to what it says:
a proven cell names a test the suite collects, a refused cell's line is the one launch.py answers with for that
composition (exit before any rank starts), and a cell that is neither is listed as open in spec/compose.py: nothing
composes silently unproven, nothing is refused that a test proves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddp_lab.spec.compose import AXES, FEATURES, OPEN, PROOFS, STRATEGY_OPEN, cell, compose_markdown, strategy_cell
from ddp_lab.spec.strategies import SPECS

ROOT = Path(__file__).resolve().parents[2]
CELLS = [(row, axis) for row in FEATURES for axis in AXES]
STRATEGY_CELLS = [(name, axis) for name in SPECS for axis in AXES]


def test_the_docs_table_is_the_commands_output():
    doc = (ROOT / "docs" / "compose.md").read_text()
    assert compose_markdown() in doc, "docs/compose.md is stale: paste `python -m ddp_lab.spec --compose` into it"


def test_every_cell_is_proven_refused_or_listed_open():
    for row, axis in CELLS:
        kind, _ = cell(row, axis)
        proven, listed = (row, axis.name) in PROOFS, (row, axis.name) in OPEN
        if kind == "refused":
            assert not proven and not listed, f"{row} on {axis.name} is refused and said to be proven or open"
        elif kind == "proven":
            assert not listed, f"{row} on {axis.name} is proven and listed as open"
        else:
            assert listed, f"{row} on {axis.name} runs unproven and unlisted: prove it, refuse it, or list it open"
    known = {(row, axis.name) for row, axis in CELLS}
    assert set(PROOFS) <= known and set(OPEN) <= known


def test_every_strategy_cell_is_proven_refused_or_listed_open():
    for name, axis in STRATEGY_CELLS:
        kind, _ = strategy_cell(name, axis)
        assert (kind == "open") == ((name, axis.name) in STRATEGY_OPEN), f"strategy={name} on {axis.name}: {kind}"


def test_every_proof_is_a_test_the_suite_collects():
    strategies = (strategy_cell(*c) for c in STRATEGY_CELLS)
    proofs = {*PROOFS.values(), *(text for kind, text in strategies if kind == "proven")}
    files = sorted({proof.split("::")[0] for proof in proofs})
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n0", "-p", "no:cacheprovider",
                                *files], cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    missing = sorted(proof for proof in proofs if proof not in collected)
    assert not missing, missing


@pytest.mark.parametrize("row, axis", [(r, a) for r, a in CELLS if cell(r, a)[0] == "refused"],
                         ids=lambda v: v if isinstance(v, str) else v.name)
def test_a_refused_cell_is_the_launchers_own_refusal(row, axis):
    from hydra import compose, initialize_config_dir

    from ddp_lab.config import register_configs
    from ddp_lab.launcher.config_checks import ConfigError, validate

    register_configs()
    keys = FEATURES[row][0].split() + axis.keys.split()
    world = max(2, axis.tp * axis.pp * axis.cp)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[*keys, f"world_size={world}"])
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    assert str(refused.value) == cell(row, axis)[1]


def test_every_refused_strategy_cell_is_the_launchers_own_refusal():
    """On 4 ranks (2 data-parallel ones beside tp, pp or cp 2), so that the strategy is the one that runs, each
    choice of strategy and model composed once (tests/helpers/composing.py)."""
    from hydra import initialize_config_dir

    from ddp_lab.config import register_configs
    from ddp_lab.launcher.config_checks import ConfigError, validate
    from tests.helpers.composing import ComposedOnce

    register_configs()
    composed, wrong = ComposedOnce(), []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        for name, axis in STRATEGY_CELLS:
            kind, line = strategy_cell(name, axis)
            if kind != "refused":
                continue
            try:
                validate(composed([f"strategy={name}", *axis.overrides, "world_size=4"]))
                wrong.append(f"strategy={name} on {axis.name}: accepted")
            except ConfigError as refused:
                if str(refused) != line:
                    wrong.append(f"strategy={name} on {axis.name}: {refused}")
    assert not wrong, "\n".join(wrong)
