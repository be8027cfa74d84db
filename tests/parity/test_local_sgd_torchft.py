"""strategy=local_sgd_torchft, torchft's streaming DiLoCo, against the same hand computation local_sgd is held to
(tests/parity/test_local_sgd.py's `_by_hand`): fragments with DiLoCo's outer Nesterov step, a delayed sync,
a delayed sync with mix, 9 steps of hand-made gradients with SGD lr 1 at 2 ranks. torchft's parameters equal
ours to float rounding: the reference agrees with the rule local_sgd implements, schedule included. Its
figures count what its manager sends."""

import pytest
import torch

from tests.helpers.distributed import ranks_fixture
from tests.helpers.extras import requires_torchft
from tests.parity.test_local_sgd import STREAMING, TwoTensors, _by_hand, hand_run

pytestmark = requires_torchft


def _torchft(rank, world_size):
    from ddp_lab.strategies import TorchftDiLoCo

    return hand_run(rank, STREAMING, TorchftDiLoCo, TwoTensors, 9)

reference = ranks_fixture(_torchft, 2)


@pytest.mark.parametrize("name", list(STREAMING))
def test_torchfts_diloco_is_the_hand_computation(reference, name):
    expected = _by_hand(STREAMING[name])
    for step in range(9):
        for rank in range(2):
            got = reference[rank][name][0][step]
            for n in ("a", "b"):
                torch.testing.assert_close(got[n].double(), expected[step][rank][n], atol=1e-5, rtol=1e-5,
                                           msg=lambda m, s=step, r=rank, n=n: f"step {s + 1} rank {r} {n}: {m}")


def test_its_bytes_are_what_its_manager_sent(reference):
    seen, facts = reference[0]["delay"]
    assert facts["local_sgd"]["implementation"] == "torchft"
    launched = [s["comm_bytes"] for s in seen]
    assert launched == [36 if (step + 1) % 4 == 3 else 0 for step in range(9)]  # a and b, a step before the sync
