"""Where each piece of a rank's mixture-of-experts layer lies in the one-process layer (ddp_lab/check/experts.py
`placement`), read from names and shapes alone: stacked experts, module lists numbered from 0 on every rank or
globally, the router whole, and a parameter that fits nowhere named."""

import pytest

from ddp_lab.check.experts import D_MODEL, EXPERTS, placement

GATE = {"gate.weight": (EXPERTS, D_MODEL)}


def test_stacked_experts_are_rows_of_every_ranks_piece():
    whole = {**GATE, "experts.w1": (EXPERTS, D_MODEL, 8)}
    piece = {**GATE, "experts.w1": (EXPERTS // 2, D_MODEL, 8)}
    assert placement([piece, piece], whole) == {"gate.weight": ("whole", 0, "gate.weight"),
                                                "experts.w1": ("stacked", None, "experts.w1")}


def _listed(experts: range) -> dict:
    return {**GATE, **{f"experts.{e}.up.weight": (8, D_MODEL) for e in experts}}


@pytest.mark.parametrize("second", [range(0, 4), range(4, 8)], ids=["from 0 on every rank", "globally"])
def test_a_module_list_of_experts_is_placed_by_its_numbering(second):
    places = placement([_listed(range(0, 4)), _listed(second)], _listed(range(EXPERTS)))
    assert places["experts.1.up.weight"] == ("listed", 0, "experts.1.up.weight")
    assert places["experts.5.up.weight"] == ("listed", 1, f"experts.{second[1]}.up.weight")
    assert places["gate.weight"] == ("whole", 0, "gate.weight")


def test_a_piece_that_fits_nowhere_is_named():
    whole = {**GATE, "experts.w1": (EXPERTS, D_MODEL, 8)}
    with pytest.raises(ValueError, match=r"experts.w1 \(3, 16, 8\) is neither the one-process layer's whole "
                                         r"experts.w1 nor its rows for 4 of 8 experts"):
        placement([{**GATE, "experts.w1": (3, D_MODEL, 8)}] * 2, whole)
    with pytest.raises(ValueError, match="extra is a parameter the one-process layer does not have"):
        placement([{**GATE, "extra": (1,)}] * 2, GATE)
