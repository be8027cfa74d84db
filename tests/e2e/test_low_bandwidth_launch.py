"""strategy=demo, local_sgd's streaming options (fragments, delay) with train.optimizer=muon (MuLoCo) and its
SparseLoCo compression (outer_topk) through launch.py on data=text, at 3 ranks (an odd world size;
tests/parity/test_demo.py and test_local_sgd.py hold them at 2 and 3, tests/e2e/test_emulated_network.py runs demo
and MuLoCo at 4 across nodes): the loss falls, the bytes are what the strategy says it sends (demo: world_size x
its bytes sent, every step; streaming local SGD: a fragment's bytes on its sync steps; SparseLoCo: every rank's
payload on sync steps), and results.json records the knobs."""

import pytest

from tests.helpers.launching import NARROW, launch, results

pytestmark = pytest.mark.slow

TEXT = ["data=text", "model=tiny", *NARROW, "model.context_length=16", "model.vocab_size=256", "train.steps=12",
        "train.warmup_steps=2", "train.batch_size=6", "train.lr=3e-3", "logger=none", "world_size=3"]
RUNS = {"demo": ["strategy=demo", "strategy.topk=8", "strategy.chunk=16"],
        "muloco_streaming": ["strategy=local_sgd", "strategy.sync_every=4", "strategy.outer=nesterov",
                             "strategy.fragments=2", "strategy.delay=1", "train.optimizer=muon"],
        "sparseloco": ["strategy=local_sgd", "strategy.sync_every=4", "strategy.outer_topk=16",
                       "strategy.outer_chunk=16"]}


@pytest.fixture(scope="module", params=list(RUNS))
def sweep(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    proc = launch(*TEXT, *RUNS[request.param], tmp_path=tmp, multirun=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = [results(tmp / "multirun" / "0")]
    assert [j["status"] for j in jobs] == ["ok"]
    return request.param, jobs


def test_the_loss_falls_at_an_odd_world_size(sweep):
    name, jobs = sweep
    for job in jobs:
        losses = [s["loss"] for s in job["steps"]]
        assert sum(losses[-3:]) / 3 < losses[0] - 0.3, (name, job["config"]["world_size"], losses)


def test_bytes_are_what_the_strategy_sends(sweep):
    name, jobs = sweep
    for job in jobs:
        facts, steps, world = job["summary"]["strategy_facts"], job["steps"], job["config"]["world_size"]
        if name == "demo":
            sent = facts["demo"]["bytes_sent_per_step"]
            assert {s["comm_bytes"] for s in steps} == {world * sent}
            assert facts["demo"]["compression"] > 4
        elif name == "sparseloco":
            plan = facts["local_sgd"]
            assert plan["outer_compression"] > 4
            assert [s["comm_bytes"] for s in steps] == [plan["fragment_bytes"][0] if (s["step"] + 1) % 4 == 0 else 0
                                                        for s in steps]
        else:
            plan = facts["local_sgd"]
            assert plan["fragments"] == 2 and plan["delay"] == 1 and len(plan["fragment_bytes"]) == 2
            # fragment 0 syncs at step 2 of each round of 4, fragment 1 at step 4: each launched a step before
            expected = [plan["fragment_bytes"][0] if (s["step"] + 1) % 4 == 1 else
                        plan["fragment_bytes"][1] if (s["step"] + 1) % 4 == 3 else 0 for s in steps]
            assert [s["comm_bytes"] for s in steps] == expected
            assert plan["peak_bytes_per_step"] < plan["bytes_per_sync"]
            assert job["config"]["train"]["optimizer"] == "muon"
