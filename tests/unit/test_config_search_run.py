"""The config search (tests/helpers/config_search.py) over the run's own schema and every model, data and network
schema: each numeric key alone at every extreme and malformed value, then sampled pairs (seed printed)."""

import pytest

from tests.helpers.config_search import (
    ACCEPTED,
    VALUES,
    assert_answered,
    run_cases,
    sample_pairs,
    why_accepted,
)

SEED = 20261127
PAIRS = 12


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    import numpy as np

    path = tmp_path_factory.mktemp("tokens") / "train.bin"
    np.arange(4096, dtype=np.uint16).tofile(path)  # a raw uint16 token file, ids below every model's vocab
    return path


def _cases(token_file):
    return run_cases(token_file)


def test_every_numeric_key_alone(token_file, tmp_path):
    accepted = set()
    for base, key, kind in _cases(token_file):
        for value in VALUES[kind]:
            if assert_answered([*base, f"{key}={value}"], [(key, value)], tmp_path / "out"):
                accepted.add((key, value))
    listed = {(k, v) for k, values in ACCEPTED.items() if not k.startswith("strategy.") for v in values}
    assert listed <= accepted, f"ACCEPTED lists values the checks refuse: {sorted(listed - accepted)}"


def test_sampled_pairs(token_file, tmp_path):
    print(f"config search pairs: seed {SEED}, {PAIRS} pairs")
    for overrides, key_values in sample_pairs(_cases(token_file), PAIRS, SEED):
        assert_answered(overrides, key_values, tmp_path / "out")


def test_why_accepted_reads_a_keys_entry():
    assert why_accepted("train.steps", "1000000000000") and why_accepted("train.steps", "-1") is None
