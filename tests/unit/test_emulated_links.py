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
