"""fsdp and fsdp_torch count their waits for communication the same way, and the counting adds no
host synchronization inside a step.

Both wait for a unit's all-gather before its forward (and backward): fsdp in its own hook, FSDP2
inside fully_shard (fsdp_torch wraps the work FSDP2 gets back so its `wait()` is timed). Both go
through `CommStats.waited()`: exposed on CPU, where the host waits; a stream order on CUDA. On CPU
here: every unit's forward wait is counted for both, exposed comm is measured for both, and no
`synchronize()` runs between the start of forward and the end of backward (before, fsdp_torch
wrapped each blocking reduce-scatter in `CommStats.exposed()`, which synchronizes twice: on CUDA a
host sync per unit inside FSDP2). The CUDA path of the same counting runs where a GPU is lent.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from ddp_lab.check.models import CONTEXT, VOCAB, tiny_transformer
from ddp_lab.check.ranks import run_ranks
from ddp_lab.strategies import FSDP, TorchFSDP

WRAPPERS = {"fsdp": FSDP, "fsdp_torch": TorchFSDP}


def _count(rank: int, world_size: int, name: str) -> dict:
    from ddp_lab.strategies import comm_stats

    calls = {"sync": 0, "waited": 0}
    synchronize, waited = comm_stats.synchronize, comm_stats.CommStats.waited

    def counting_sync(device):
        calls["sync"] += 1
        synchronize(device)

    @contextlib.contextmanager
    def counting_waited(self):
        calls["waited"] += 1
        with waited(self):
            yield

    comm_stats.synchronize, comm_stats.CommStats.waited = counting_sync, counting_waited
    torch.manual_seed(rank)
    ddp = WRAPPERS[name](tiny_transformer())
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    tokens = torch.randint(0, VOCAB, (4, CONTEXT), generator=torch.Generator().manual_seed(rank))
    seen = []
    for _ in range(2):
        calls.update(sync=0, waited=0)
        logits = ddp(tokens)
        forward_waits = calls["waited"]
        logits.float().pow(2).mean().backward()
        in_step = dict(calls)
        ddp.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seen.append({"forward_waits": forward_waits, **in_step, "after_finish": calls["sync"],
                     **ddp.comm.pop()})
    units = len(ddp._hooked) if name == "fsdp" else len(ddp._units)
    return {"units": units, "steps": seen}


@pytest.fixture(scope="module")
def counted():
    return {name: run_ranks(_count, 2, name) for name in WRAPPERS}


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_waits_counted_alike_and_no_synchronization_inside_the_step(counted, name):
    for rank in counted[name]:
        for step in rank["steps"]:
            assert step["forward_waits"] >= rank["units"], (name, step)  # every unit's gather waited for
            assert step["sync"] == 0, (name, step)                    # none between forward and backward's end
            assert step["after_finish"] <= 2, (name, step)            # finish's own: one pair per step
            assert step["exposed_comm_ms"] > 0 and step["comm_ms"] > 0, (name, step)
