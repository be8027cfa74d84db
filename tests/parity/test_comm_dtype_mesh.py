"""`strategy.comm_dtype` on a mesh: bucketed with bf16 on the wire, on the data-parallel axis of every mesh
docs/compose.md has a column for, against one process that averages in fp32.

The optimizer is SGD without momentum, so a weight's update is lr x its delivered gradient, and the run's distance
from one process's is the delivered gradient's error. Measured relative to the update (over every weight, two
steps), it lies above float32's rounding, so the wire really was bf16 (the same job with fp32 on the wire measures
below 1e-5: the control case, 1.5e-6 here), and within bf16's: 2^-8 is one rounding of a value, the ring rounds each
partial sum again, and 2^-6 leaves room for that at 2 and 4 ranks (2.2e-3 measured on every mesh here). A sum over
the wrong group, or a missing one, is off by a whole gradient (tests/parity/test_comm_dtype.py proves each
strategy's average exact to the dtype's rounding with chosen gradients, on data parallelism alone)."""

from __future__ import annotations

import math

import pytest
import torch

from ddp_lab.check.parity import MODELS, train_on_mesh
from tests.helpers.distributed import ranks_fixture
from tests.helpers.mesh_axes import AXIS_JOBS

CASES = AXIS_JOBS  # compose.md's columns
CONTROL = "tp, fp32 on the wire"
FLOAT32, BF16 = 1e-5, 2.0 ** -6


def _relative_error(rank, world_size, model, wire: str, kw: dict) -> float | None:
    """||the run's weights - one process's|| / ||one process's update||, on rank 0 (None elsewhere)."""
    weights, reference = train_on_mesh(rank, world_size, model, "bucketed", steps=2, knobs={"comm_dtype": wire},
                                       optimizer_cls=torch.optim.SGD, opt_kwargs={"lr": 0.1, "weight_decay": 0.0},
                                       **kw)
    if reference is None:
        return None
    torch.manual_seed(0)  # rank 0's model, every rank's start (train_on_mesh seeds each rank by its number)
    start = (MODELS[model]() if isinstance(model, str) else model()).state_dict()
    error = math.sqrt(sum((weights[n] - r).pow(2).sum().item() for n, r in reference.items()))
    update = math.sqrt(sum((r - start[n]).pow(2).sum().item() for n, r in reference.items()))
    return error / update


def _errors(rank, world_size):
    out = {case: _relative_error(rank, world_size, model, "bf16", kw) for case, (model, kw) in CASES.items()}
    out[CONTROL] = _relative_error(rank, world_size, "transformer", "fp32", dict(tp=2))
    return out


errors = ranks_fixture(_errors, 4)


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_on_the_wire_delivers_the_average_to_its_rounding_on_every_mesh(errors, case):
    measured = errors[0][case]
    assert FLOAT32 < measured < BF16, (case, measured)


def test_fp32_on_the_wire_is_one_process_to_float32_rounding(errors):
    """The control that makes the lower bound mean something: the same job with fp32 on the wire."""
    assert errors[0][CONTROL] < FLOAT32, errors[0][CONTROL]
