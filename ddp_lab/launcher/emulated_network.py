"""network=emulated: nodes as Linux network namespaces joined by rate-limited links, on one machine.

Each emulated node is a network namespace with its own loopback (traffic between ranks of one node stays
inside it) and one veth link to a bridge that joins the nodes; a `tbf` qdisc shapes both ends of each
link to `network.gbps`, so a node sends and receives at most that rate (`network.slow_node`'s link to
`network.slow_gbps`: one slow link, from the start or, with `network.slow_step`, from a step on: `slow_down()`
changes both ends of it while the job runs). launch.py runs one torchrun per
node inside its namespace (`ip netns exec`) through the multi-node path real nodes use: torchrun's static
rendezvous on node 0's address, gloo bound to the node's link (GLOO_SOCKET_IFNAME).

Every name carries the launcher's pid and its process start time (`/proc/PID/stat`, field 22):
namespaces `ddp-lab-PID-START-JOB-nK` and, for links (15 characters at most), a short name whose
alias (`ip link ... alias`) holds the same `ddp-lab PID START`. Two jobs at once never collide (their
pids differ; a sweep's jobs run one after another, numbered). Everything is removed by name when the
job ends, however it ends; a namespace or link whose launcher is gone (no process with that pid, or one
that started at another time: the pid was reused) was left by a launch.py that was SIGKILLed, and the
next emulated launch removes it. Nothing without the `ddp-lab` mark is ever touched.

Needs root and iproute2 (`ip`, `tc`); `ip netns`, veth, bridge and tbf are in every mainstream kernel.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass, field

NS_PREFIX = "ddp-lab-"
LINK_PREFIX = "dl"
MARK = "ddp-lab"
SUBNET = "10.213.0"  # inside each job's own bridge: jobs never see each other's addresses
NODE_IF = "eth0"  # the node's end of its link, inside its namespace
RDZV_PORT = 29500  # free in a fresh namespace
_jobs = itertools.count()


class NetworkError(RuntimeError):
    """The emulated network cannot be set up here: one line."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetworkError(f"{' '.join(cmd)}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return proc


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def problem() -> str | None:
    """Why network=emulated cannot run on this machine, or None."""
    if os.geteuid() != 0:
        return "network=emulated needs root (network namespaces, links and qdiscs): run as root or use network=host"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"network=emulated needs iproute2 ({', '.join(missing)} not found): install it or use network=host"
    return None


def netem_problem() -> str | None:
    """Why this kernel cannot add delay (no netem qdisc), or None: tried in a namespace made for it."""
    ns = f"{NS_PREFIX}{os.getpid()}-{_start_time(os.getpid())}-probe"
    try:
        _run("ip", "netns", "add", ns)
        proc = _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                    check=False)
        return None if proc.returncode == 0 else f"this kernel has no 'netem' qdisc ({proc.stderr.strip()})"
    finally:
        _run("ip", "netns", "del", ns, check=False)


@dataclass
class EmulatedNodes:
    """`with EmulatedNodes(nodes, gbps) as net:` the namespaces and links exist; `net.exec_prefix(k)`
    runs a command on node k; on leaving, every one of them is gone."""

    nodes: int
    gbps: float | None = None
    latency_ms: float | None = None
    slow_node: int | None = None  # this node's link runs at slow_gbps instead of gbps
    slow_gbps: float | None = None
    slow_later: bool = False  # the slow node's link starts at gbps; slow_down() turns it to slow_gbps
    pid: int = field(default_factory=os.getpid)
    start: str | None = None  # the launcher's start time (default: read from /proc for `pid`)
    job: int = field(default_factory=lambda: next(_jobs))

    def __post_init__(self):
        self.start = self.start or _start_time(self.pid)
        self.namespaces = [f"{NS_PREFIX}{self.pid}-{self.start}-{self.job}-n{k}" for k in range(self.nodes)]
        short = f"{LINK_PREFIX}{self.pid:x}j{self.job % 100}"  # at most 2 + 6 + 1 + 2 + 1 + 3 characters
        self.bridge = f"{short}b"
        self.host_links = [f"{short}h{k}" for k in range(self.nodes)]
        self.node_links = [f"{short}n{k}" for k in range(self.nodes)]  # renamed NODE_IF inside the namespace
        self.alias = f"{MARK} {self.pid} {self.start}"

    @property
    def rdzv_endpoint(self) -> str:
        return f"{self.address(0)}:{RDZV_PORT}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def exec_prefix(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[node]]

    def __enter__(self) -> "EmulatedNodes":
        remove_stale()
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _create(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "alias", self.alias)
        _run("ip", "link", "set", self.bridge, "up")
        for k, (ns, host, node_end) in enumerate(zip(self.namespaces, self.host_links, self.node_links)):
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", host, "type", "veth", "peer", "name", node_end)
            _run("ip", "link", "set", host, "alias", self.alias)
            _run("ip", "link", "set", host, "master", self.bridge)
            _run("ip", "link", "set", host, "up")
            _run("ip", "link", "set", node_end, "netns", ns)
            _run("ip", "-n", ns, "link", "set", node_end, "name", NODE_IF)
            _run("ip", "-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", NODE_IF)
            _run("ip", "-n", ns, "link", "set", NODE_IF, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            gbps = self.slow_gbps if k == self.slow_node and not self.slow_later else self.gbps
            if gbps:
                self._shape_link(k, gbps)
            if self.latency_ms:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", NODE_IF, "parent", "1:1" if gbps
                     else "root", "netem", "delay", f"{self.latency_ms}ms")

    def _shape_link(self, node: int, gbps: float, verb: str = "add") -> None:
        _shape(["tc"], self.host_links[node], gbps, verb)
        _shape(["ip", "netns", "exec", self.namespaces[node], "tc"], NODE_IF, gbps, verb)

    def slow_down(self) -> None:
        """The slow node's link, both ends, to slow_gbps now: `tc qdisc change` of the token bucket in place where
        the link was shaped (a `replace` mid-run hung a job's collectives: docs/network.md), else `add`."""
        self._shape_link(self.slow_node, self.slow_gbps, "change" if self.gbps else "add")

    def remove(self) -> None:
        """Every namespace and link of this job, by name (a veth's two ends go together)."""
        for ns in self.namespaces:
            _run("ip", "netns", "del", ns, check=False)
        for link in [*self.host_links, self.bridge]:
            _run("ip", "link", "del", link, check=False)


def _shape(tc: list[str], dev: str, gbps: float, verb: str = "add") -> None:
    """A token bucket at `gbps` on `dev`'s egress: a burst of 1 ms of traffic (at least 64 KiB), and at most
    100 ms of queue. `verb`: tc's add, or replace (whatever root qdisc was there)."""
    rate_bytes = gbps * 1e9 / 8
    burst = max(int(rate_bytes / 1000), 64 * 1024)
    _run(*tc, "qdisc", verb, "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{gbps}gbit", "burst", str(burst),
         "latency", "100ms")


def _live(pid: str, start: str) -> bool:
    return pid.isdigit() and _start_time(int(pid)) == start


def _marked_namespaces() -> list[tuple[str, str, str]]:
    """ddp-lab's namespaces, whoever made them, as (name, launcher pid, its start time) read from the name."""
    out = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        if line.startswith(NS_PREFIX):
            name = line.split()[0]
            out.append((name, *(name[len(NS_PREFIX):].split("-") + ["", ""])[:2]))
    return out


def _marked_links() -> list[tuple[str, str, str]]:
    """ddp-lab's links, whoever made them, as (name, launcher pid, its start time) read from the alias."""
    out = []
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(LINK_PREFIX) and f"alias {MARK} " in line:
            out.append((name, *(line.split(f"alias {MARK} ", 1)[1].split() + ["", ""])[:2]))
    return out


def ours() -> tuple[list[str], list[str]]:
    """(namespaces, links) carrying ddp-lab's mark, whoever made them."""
    return [name for name, *_ in _marked_namespaces()], [name for name, *_ in _marked_links()]


def remove_stale() -> list[str]:
    """Remove every namespace and link whose launcher (the pid and start time in its name or alias) is gone;
    return their names. Links are listed after the namespaces went: a veth goes with its end in one."""
    removed = []
    for kind, marked in (("netns", _marked_namespaces), ("link", _marked_links)):
        for name, pid, start in marked():
            if not _live(pid, start):
                _run("ip", kind, "del", name, check=False)
                removed.append(name)
    return removed
