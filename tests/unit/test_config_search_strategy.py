"""The config search (tests/helpers/config_search.py) over every strategy's numeric knobs: each alone at every
extreme and malformed value, then sampled pairs (seed printed). A file of its own so that the two halves of the
search run on the suite's two workers."""

from tests.helpers.config_search import ACCEPTED, VALUES, assert_answered, sample_pairs, strategy_cases

SEED = 20261128
PAIRS = 12


def test_every_strategy_knob_alone(tmp_path):
    accepted = set()
    for base, key, kind in strategy_cases():
        for value in VALUES[kind]:
            if assert_answered([*base, f"{key}={value}"], [(key, value)], tmp_path / "out"):
                accepted.add((key, value))
    listed = {(k, v) for k, values in ACCEPTED.items() if k.startswith("strategy.") for v in values}
    assert listed <= accepted, f"ACCEPTED lists values the checks refuse: {sorted(listed - accepted)}"


def test_sampled_pairs(tmp_path):
    print(f"config search pairs: seed {SEED}, {PAIRS} pairs")
    for overrides, key_values in sample_pairs(strategy_cases(), PAIRS, SEED):
        assert_answered(overrides, key_values, tmp_path / "out")
