"""What results.json records of an injected fault or slow link (`summary.injected`, `summary.injected_link`), so
no injected run passes for a clean one. Read from the config alone: the rank writes the fault's record, the
launcher the link's (it makes the link slow) and, for a job that failed, the fault's too."""

from __future__ import annotations


def injected(fault) -> dict | None:
    """`summary.injected`: the fault (fault.kind, its rank or node, step, slowdown), None when there is none."""
    kind = str(getattr(fault.kind, "value", fault.kind))
    if kind == "none":
        return None
    return {"kind": kind, "rank": int(fault.rank), "step": int(fault.step),
            **({"node": int(fault.node)} if getattr(fault, "node", None) is not None else {}),
            **({"slowdown": float(fault.slowdown)} if kind == "slow" else {})}


def injected_link(network) -> dict | None:
    """`summary.injected_link` before the run: the slow node's link, its rate and the step it turns slow at
    (network.slow_step; 0: the whole run); None without one (or off emulated nodes)."""
    if network is None or network.name != "emulated" or network.slow_node is None:
        return None
    return {"kind": "slow link", "node": int(network.slow_node), "gbps": float(network.slow_gbps),
            "step": int(network.slow_step)}
