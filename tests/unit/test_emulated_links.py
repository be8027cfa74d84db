"""The emulated links' shaping, read from the commands EmulatedNodes would run (no namespace is made)."""

from __future__ import annotations

from ddp_lab.launcher import emulated_network
from ddp_lab.launcher.emulated_network import EmulatedNodes


def _commands(monkeypatch, nodes: EmulatedNodes) -> list[tuple[str, ...]]:
    ran = []
    monkeypatch.setattr(emulated_network, "_run", lambda *cmd, check=True: ran.append(cmd))
    nodes._create()
    return ran


def _rates(ran, nodes: EmulatedNodes) -> dict[str, list[str]]:
    """{link end: the tbf rates shaping it}: each node's host end and its end inside its namespace."""
    out: dict[str, list[str]] = {}
    for cmd in ran:
        if "tbf" in cmd:
            end = cmd[cmd.index("dev") + 1]
            where = cmd[3] if cmd[:3] == ("ip", "netns", "exec") else "host"
            out.setdefault(f"{where}:{end}", []).append(cmd[cmd.index("rate") + 1])
    return out


def test_one_slow_node_has_both_ends_of_its_link_at_its_own_rate(monkeypatch):
    nodes = EmulatedNodes(3, 1.0, slow_node=1, slow_gbps=0.25, pid=1, start="1")
    rates = _rates(_commands(monkeypatch, nodes), nodes)
    for k in range(3):
        want = ["0.25gbit"] if k == 1 else ["1.0gbit"]
        assert rates[f"host:{nodes.host_links[k]}"] == want and rates[f"{nodes.namespaces[k]}:eth0"] == want


def test_without_a_slow_node_every_link_has_the_same_rate(monkeypatch):
    nodes = EmulatedNodes(2, 0.5, pid=1, start="1")
    rates = _rates(_commands(monkeypatch, nodes), nodes)
    assert sorted(rates.values()) == [["0.5gbit"]] * 4


def test_a_link_slow_from_a_step_starts_at_the_common_rate_and_slow_down_changes_both_ends(monkeypatch):
    nodes = EmulatedNodes(2, 1.0, slow_node=1, slow_gbps=0.25, slow_later=True, pid=1, start="1")
    ran = _commands(monkeypatch, nodes)
    assert sorted(_rates(ran, nodes).values()) == [["1.0gbit"]] * 4
    ran.clear()
    nodes.slow_down()
    slow_ends = {f"host:{nodes.host_links[1]}": ["0.25gbit"], f"{nodes.namespaces[1]}:eth0": ["0.25gbit"]}
    assert _rates(ran, nodes) == slow_ends
    # in place: a replaced qdisc mid-collective hung fsdp's job in 1 of 2 runs (docs/network.md), a changed one never
    assert {cmd[cmd.index("qdisc") + 1] for cmd in ran} == {"change"}
    unshaped = EmulatedNodes(2, None, slow_node=1, slow_gbps=0.25, slow_later=True, pid=1, start="1")
    ran = _commands(monkeypatch, unshaped)
    assert _rates(ran, unshaped) == {}
    ran.clear()
    unshaped.slow_down()
    assert {cmd[cmd.index("qdisc") + 1] for cmd in ran} == {"add"}  # nothing to change: a new token bucket


def test_the_launcher_slows_the_link_once_rank_0_recorded_the_step_before(tmp_path):
    from omegaconf import OmegaConf

    from ddp_lab.launcher.job import SlowLinkFrom

    class Net:
        slowed = 0

        def slow_down(self):
            self.slowed += 1

    cfg = OmegaConf.create({"network": {"name": "emulated", "slow_node": 1, "slow_gbps": 0.25, "slow_step": 3}})
    net = Net()
    link = SlowLinkFrom(cfg, tmp_path, net)
    link.tick()  # no steps.jsonl yet
    with open(tmp_path / "steps.jsonl", "w") as f:
        f.write('{"step": 0}\n{"step": 1}\n{"step": 2, "loss"')  # the third line is still being written
    link.tick()
    assert net.slowed == 0 and link.record()["made_in_step"] is None  # not reached: said so
    with open(tmp_path / "steps.jsonl", "a") as f:
        f.write(': 1.0}\n')
    link.tick()
    link.tick()
    assert net.slowed == 1
    assert link.record() == {"kind": "slow link", "node": 1, "gbps": 0.25, "step": 3, "made_in_step": 3}
    class Broken:
        def slow_down(self):
            raise emulated_network.NetworkError("tc qdisc replace ...: RTNETLINK answers: No such device")

    failing = SlowLinkFrom(cfg, tmp_path, Broken())
    failing.tick()
    assert failing.record()["made_in_step"] is None and "No such device" in failing.record()["error"]
    whole_run = OmegaConf.create({"network": {"name": "emulated", "slow_node": 0, "slow_gbps": 0.5, "slow_step": 0}})
    assert SlowLinkFrom(whole_run, tmp_path, net).record()["made_in_step"] == 0
    assert SlowLinkFrom(OmegaConf.create({"network": {"name": "host"}}), tmp_path, None).record() is None
