"""Run one job's ranks with torchrun as a child process and map its end to a status.

launch.py (one process per sweep job, and per node) calls `run_job`. torchrun is started in a
session of its own, so only the launcher decides when it stops: on Ctrl-C or SIGTERM, or when
`launcher.watchdog_s` runs out, it sends SIGTERM to torchrun (which passes it on to its ranks),
waits `GRACE_S`, then SIGKILLs torchrun and any rank of this job still alive. torchrun starts each
rank in a session of its own too, so they are found by a mark in their environment that only this
launcher's children carry (`DDP_LAB_LAUNCHER`), never by a broad name: the nodes of a job may
share its folder and, under slurm_local, this machine. Nothing this job started outlives it.

network=emulated (launcher/emulated_network.py): one launch.py runs every node of the job, one torchrun
per node inside the node's network namespace, each with the command a real node would run; it waits
for all of them and stops all of them, and the namespaces and links go with the job. With
`network.slow_step` it also turns the slow node's link slow at that step (`SlowLinkFrom`), and records
every injected slow link in results.json (`summary.injected_link`).

Multi-node: torchrun's *static* rendezvous, not c10d. c10d numbers the nodes in order of
(hostname, pid) and ignores `--node-rank` (torchrun warns so), which could put global rank 0, the
one that writes results.json and the W&B run, on any node. Static makes node_rank N own ranks
[N·k, (N+1)·k), so rank 0 is on node_rank 0, whose job folder holds the results.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ddp_lab.arithmetic.stats import summarize_steps
from ddp_lab.jobdir import (
    RESULTS,
    STEPS,
    make_results,
    node_file,
    read_results,
    read_steps,
    torchrun_log,
    write_json_atomic,
)
from ddp_lab.launcher.emulated_network import NODE_IF, EmulatedNodes, NetworkError
from ddp_lab.launcher.failures import diagnose, oom_kills
from ddp_lab.launcher.resume import set_aside_previous_attempt
from ddp_lab.spec.injection import injected, injected_link

GRACE_S = 15  # torchrun's own SIGTERM-to-SIGKILL wait is 30 s: the launcher does not wait that long
REPO_ROOT = Path(__file__).resolve().parents[2]
MARK = "DDP_LAB_LAUNCHER"


class Interrupted(Exception):
    pass


def torchrun_command(cfg: DictConfig, job_dir: Path) -> list[str]:
    """`python -m torch.distributed.run ... -m ddp_lab.rank.worker JOB_DIR`: torchrun's own rendezvous."""
    launcher = cfg.launcher
    nproc = cfg.world_size // launcher.nnodes
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--max-restarts={launcher.max_restarts}",
           "--monitor-interval=0.2"]
    if launcher.nnodes == 1:
        cmd.append("--standalone")  # c10d rendezvous on a free port of this machine: sweeps never collide
    else:
        cmd += [f"--nnodes={launcher.nnodes}", f"--node-rank={launcher.node_rank}", "--rdzv-backend=static",
                f"--rdzv-endpoint={launcher.rdzv_endpoint}"]
    return cmd + ["-m", "ddp_lab.rank.worker", str(job_dir)]


def worker_env(cfg: DictConfig, ranks_on_this_machine: int | None = None) -> dict:
    env = dict(os.environ)
    local_ranks = ranks_on_this_machine or cfg.world_size // cfg.launcher.nnodes
    # torchrun would set 1 and warn; share this machine's cores among its ranks instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // local_ranks)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Workers import ddp_lab from this checkout even when it is not pip-installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env[MARK] = f"{os.getpid()}:{cfg.launcher.node_rank}"  # this launcher's torchrun and ranks, no one else's
    if cfg.launcher.max_restarts:
        # Restarted workers must not share torchrun's rendezvous store: in it the failed generation's keys
        # remain, and a new rank could read the old rank 0's address (gloo: "connectFullMesh failed ...
        # Connection refused", 1 restart in 3 here; pytorch/pytorch#135712, #167288). With this, rank 0
        # hosts a fresh store for each generation.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def started_here(job_dir: Path) -> list[int]:
    """Pids of the processes this launcher started for this job (torchrun, ranks), by their mark."""
    mark = f"{MARK}={os.getpid()}:".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if os.fsencode(str(job_dir)) not in (entry / "cmdline").read_bytes().split(b"\0"):
                continue
            if any(var.startswith(mark) for var in (entry / "environ").read_bytes().split(b"\0")):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(child: subprocess.Popen, job_dir: Path, hurry: list) -> None:
    """SIGTERM torchrun (it stops its ranks), wait GRACE_S, then SIGKILL torchrun and this job's ranks.

    A signal that arrives while waiting (a second Ctrl-C) lands in `hurry` and ends the wait.
    """
    if child.poll() is None:
        _signal_group(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while child.poll() is None and time.monotonic() < deadline and not hurry:
            time.sleep(0.1)
    if child.poll() is None:  # only while it is unreaped: its pid cannot have been reused
        _signal_group(child.pid, signal.SIGKILL)
    for pid in started_here(job_dir):  # ranks live in sessions of their own: killpg(torchrun) misses them
        _signal_group(pid, signal.SIGKILL)
    child.wait()


def node_launches(cfg: DictConfig, job_dir: Path, net: EmulatedNodes | None) -> list[tuple[int, list[str], dict]]:
    """(node rank, command, environment) of each torchrun this launcher starts: its own node's, or on
    emulated nodes every node's, inside the node's namespace, with gloo on the node's link."""
    if net is None:
        return [(cfg.launcher.node_rank, torchrun_command(cfg, job_dir), worker_env(cfg))]
    launches = []
    for node in range(net.nodes):
        node_cfg = OmegaConf.merge(cfg, {"launcher": {"nnodes": net.nodes, "node_rank": node,
                                                      "rdzv_endpoint": net.rdzv_endpoint}})
        env = {**worker_env(node_cfg, ranks_on_this_machine=cfg.world_size), "GLOO_SOCKET_IFNAME": NODE_IF}
        launches.append((node, net.exec_prefix(node) + torchrun_command(node_cfg, job_dir), env))
    return launches


def _emulated(cfg: DictConfig):
    """The emulated nodes of network=emulated, set up for the job; nothing for network=host."""
    network = OmegaConf.select(cfg, "network")
    if network is None or network.name != "emulated":
        return nullcontext()
    return EmulatedNodes(network.nodes, network.gbps, network.latency_ms, slow_node=network.slow_node,
                         slow_gbps=network.slow_gbps, slow_later=bool(network.slow_step))


class SlowLinkFrom:
    """network.slow_step: turns the slow node's link slow once rank 0 has recorded the step before it (read
    from JOB/steps.jsonl as it grows, only its new bytes each tick), and says what was injected and when
    (`record()`: results.json's `summary.injected_link`)."""

    def __init__(self, cfg: DictConfig, job_dir: Path, net: EmulatedNodes | None):
        self.injected = injected_link(OmegaConf.select(cfg, "network")) if net is not None else None
        self.net, self.path = net, job_dir / STEPS
        self.step = self.injected["step"] if self.injected else None
        self.offset, self.done = 0, 0  # bytes of steps.jsonl read; steps recorded (the next one's index)
        self.made_in_step = 0 if self.injected and not self.step else None

    def tick(self) -> None:
        if self.step is None or self.made_in_step is not None or not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            *complete, _ = f.read().split(b"\n")  # the last piece: a line still being written, or b""
        for line in complete:
            self.offset += len(line) + 1
            self.done = json.loads(line)["step"] + 1
        if self.done >= self.step:
            try:
                self.net.slow_down()
            except NetworkError as exc:  # the job goes on unshaped there: said in the record, not raised
                self.step, self.injected = None, {**self.injected, "error": str(exc)}
                return
            self.made_in_step = self.done  # the step rank 0 was in once both ends had changed (or later)

    def record(self) -> dict | None:
        """None without a slow link; else the link, its step, and `made_in_step` (None: never made)."""
        return None if self.injected is None else {**self.injected, "made_in_step": self.made_in_step}


def _wait(children: list[subprocess.Popen], timeout_s: float, tick=lambda: None) -> int | None:
    """Until every child has ended, or one has failed: returns the index of the first that failed (None:
    none did); TimeoutExpired after `timeout_s` (0: no limit). One failed node fails the job, and the
    other nodes are stopped (by the caller), not waited for: their ranks could wait on the failed ones
    for ever (emulated nodes, a rank hung alone on its node). `tick()` runs every 0.1 s meanwhile."""
    deadline = time.monotonic() + timeout_s if timeout_s else None
    while any(child.poll() is None for child in children):
        failed = [i for i, child in enumerate(children) if child.poll() not in (None, 0)]
        if failed:
            return failed[0]
        if deadline is not None and time.monotonic() > deadline:
            raise subprocess.TimeoutExpired("torchrun", timeout_s)
        tick()
        time.sleep(0.1)
    failed = [i for i, child in enumerate(children) if child.returncode != 0]
    return failed[0] if failed else None


def run_job(cfg: DictConfig, job_dir: Path) -> dict:
    """Start the ranks, wait, and return the job's results (also written to JOB_DIR/results.json)."""
    job_dir = Path(job_dir).resolve()
    local = cfg.world_size // cfg.launcher.nnodes
    node_ranks = range(cfg.launcher.node_rank * local, (cfg.launcher.node_rank + 1) * local)
    set_aside_previous_attempt(job_dir, cfg.launcher.node_rank, node_ranks)  # a re-run starts clean
    (job_dir / torchrun_log(0)).parent.mkdir(parents=True, exist_ok=True)
    oom_before = oom_kills()
    stopped, children, late, first_failed = None, [], [], None  # stopped: None, "interrupted" or "watchdog"
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_interrupted)}
    try:
        with _emulated(cfg) as net:  # network=emulated: removed on every way out of this block
            link = SlowLinkFrom(cfg, job_dir, net)
            try:
                for node, command, env in node_launches(cfg, job_dir, net):
                    with open(job_dir / torchrun_log(node), "ab") as log:
                        children.append((node, subprocess.Popen(command, env=env, stderr=log,
                                                                start_new_session=True)))
                first_failed = _wait([child for _, child in children], cfg.launcher.watchdog_s, link.tick)
            except subprocess.TimeoutExpired:
                stopped = "watchdog"
            except (KeyboardInterrupt, Interrupted):
                stopped = "interrupted"
            finally:
                # While stopping, a signal must not cut the clean-up short: note it and go on.
                previous[signal.SIGINT] = signal.signal(signal.SIGINT, lambda signum, frame: late.append(signum))
                signal.signal(signal.SIGTERM, lambda signum, frame: late.append(signum))
                for _, child in children:
                    _stop(child, job_dir, hurry=late)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    failed = [(node, child.returncode) for node, child in children if child.returncode != 0]
    if first_failed is not None:  # the node that failed first names the cause, not one stopped after it
        failed.sort(key=lambda item: item[0] != children[first_failed][0])
    returncode = failed[0][1] if failed else (0 if children else None)
    if late and stopped is None and returncode != 0:
        stopped = "interrupted"
    results = finalize(cfg, job_dir, returncode, stopped, oom_kills() > oom_before,
                       log_node=failed[0][0] if failed else cfg.launcher.node_rank, link=link.record())
    if late and stopped != "interrupted":
        signal.raise_signal(late[0])  # the job was over when it came: pass it on to the sweep
    return results


def _raise_interrupted(signum, frame):
    raise Interrupted()


def finalize(cfg: DictConfig, job_dir: Path, returncode: int | None, stopped: str | None,
             oom_killed: bool = False, log_node: int | None = None, link: dict | None = None) -> dict:
    """Keep rank 0's results when the job succeeded; otherwise write a failed/interrupted record
    that keeps every step already measured. A node other than node_rank 0 writes node{N}.json.
    `log_node`: the node whose torchrun log explains a failure (an emulated job's failing node);
    `link`: the slow link this launcher made (SlowLinkFrom.record), the summary's `injected_link`."""
    node = cfg.launcher.node_rank
    results = read_results(job_dir) if node == 0 else None
    if returncode == 0 and stopped is None and (results is not None or node > 0):
        status, error = "ok", None
    elif stopped == "interrupted":
        done = len(results["steps"]) if results else len(read_steps(job_dir))
        status, error = "interrupted", f"stopped by Ctrl-C or SIGTERM after {done} step(s), before the job ended"
    elif stopped == "watchdog":
        status = "failed"
        error = (f"launcher.watchdog_s={cfg.launcher.watchdog_s:g}: the job was still running after "
                 f"{cfg.launcher.watchdog_s:g} s and was stopped (no collective timeout ended it)")
    else:
        status = "failed"
        log = job_dir / torchrun_log(node if log_node is None else log_node)
        error = diagnose(job_dir, returncode, log.read_text(errors="replace") if log.exists() else "",
                         oom_killed, cfg.backend.timeout_s)
    if node > 0:
        record = {"status": status, "error": error, "node_rank": node, "nnodes": cfg.launcher.nnodes,
                  "torchrun_exit_code": returncode, "results": "in node_rank 0's job folder"}
        write_json_atomic(job_dir / node_file(node), record)
        return {**record, "config": OmegaConf.to_container(cfg, resolve=True), "summary": {}, "steps": []}
    if status == "ok":
        if link is not None:
            results["summary"]["injected_link"] = link
            write_json_atomic(job_dir / RESULTS, results)
        return results
    steps = results["steps"] if results else read_steps(job_dir)
    summary = results["summary"] if results else (summarize_steps(steps, cfg) if steps else {})
    if results is None and OmegaConf.select(cfg, "fault") is not None:
        summary = {**summary, "injected": injected(cfg.fault)}  # what rank 0 would have written: the cause
    if link is not None:
        summary = {**summary, "injected_link": link}
    env = results["env"] if results else {"world_size": cfg.world_size}
    results = make_results(status, error, OmegaConf.to_container(cfg, resolve=True), env, summary, steps)
    write_json_atomic(job_dir / RESULTS, results)
    return results
