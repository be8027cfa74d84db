"""fault.kind=slow (rank/faults.py): the rank's compute stretched by its slowdown, piece by piece, before the
strategy's own hooks see a gradient; on a clock the test moves by hand, so nothing here is timed."""

import torch
from torch import nn

from ddp_lab.rank.faults import SlowCompute
from ddp_lab.spec.figures import INJECTED_DELAY
from ddp_lab.spec.injection import injected


class Clock:
    def __init__(self):
        self.now, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_each_piece_of_compute_is_stretched_before_the_strategys_hooks_run():
    clock = Clock()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

    def tick(*_):
        clock.now += 1.0  # every leaf's forward and every gradient's arrival takes 1 s of compute

    for leaf in model:
        leaf.register_forward_pre_hook(tick)
    slow = SlowCompute(model, slowdown=3.0, clock=clock, sleep=clock.sleep)
    seen = []  # the strategy's hook, registered after: when it sees each gradient
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(clock.now))
    model(torch.ones(1, 4)).sum().backward()
    assert clock.slept == [] and slow.pop() == {}  # not active yet: nothing added, no figure
    slow.active = True
    clock.slept.clear()
    seen.clear()
    start = clock.now
    out = model(torch.ones(1, 4))
    assert clock.slept == [2.0, 2.0, 2.0]  # each leaf's 1 s of forward, twice more
    clock.now += 1.0  # the loss
    out.sum().backward()
    assert clock.slept[3] == 2.0 and sum(clock.slept[4:]) == 0.0  # the loss's 1 s: backward took no clock time
    assert min(seen) - start == 3 * 3.0 + 3.0  # the strategy saw a gradient only after the stretched forward and loss
    assert slow.pop() == {INJECTED_DELAY.key: sum(clock.slept) * 1e3} and slow.pop()[INJECTED_DELAY.key] == 0.0


def test_a_rank_of_slowdown_one_adds_nothing_and_still_has_the_figure():
    clock = Clock()
    model = nn.Linear(2, 2)
    slow = SlowCompute(model, slowdown=1.0, clock=clock, sleep=clock.sleep)
    slow.active = True
    clock.now += 5.0
    model(torch.ones(1, 2)).sum().backward()
    assert clock.slept == [] and slow.pop() == {INJECTED_DELAY.key: 0.0}


def test_results_record_the_injection():
    class Fault:
        kind, rank, step, slowdown = "slow", 1, 3, 1.5

    assert injected(Fault) == {"kind": "slow", "rank": 1, "step": 3, "slowdown": 1.5}
    Fault.kind = "none"
    assert injected(Fault) is None


def test_a_fault_on_a_node_is_every_rank_of_it_and_is_recorded(monkeypatch):
    from omegaconf import OmegaConf

    from ddp_lab.rank.faults import aimed_at

    fault = OmegaConf.create({"kind": "slow", "rank": 0, "node": 1, "step": 2, "slowdown": 2.0})
    monkeypatch.setenv("GROUP_RANK", "1")  # torchrun's: this rank's node
    assert aimed_at(fault, rank=2) and aimed_at(fault, rank=3)
    monkeypatch.setenv("GROUP_RANK", "0")
    assert not aimed_at(fault, rank=0)  # fault.rank=0 is not used where a node is given
    assert injected(fault) == {"kind": "slow", "rank": 0, "step": 2, "node": 1, "slowdown": 2.0}
    from ddp_lab.analysis.records import injected_text

    assert injected_text(injected(fault)) == "slow 2x node 1"
    assert aimed_at(OmegaConf.create({"rank": -1, "node": None}), rank=3)
