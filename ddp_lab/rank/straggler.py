"""Every rank's collective stamps gathered each step: skew and transfer per step, the straggler verdict, and
which collective was exposed and why.

After each step (outside its timed region) one `all_gather_object` brings rank 0 every rank's stamps of the
step's collectives (entry, completion: strategies/comm_stats.py), its time drawing the step's batch, its
forward and backward lap, and when its backward and its gradient sync ended. arithmetic/skew.py splits them
into skew and transfer, keeps each rank's (and, on several nodes, each node's) blame and lateness and each
collective's exposure; at the end `verdict()` names the rank or node that made the others wait
(`summary.straggler`) and `exposure()` gives the per-collective table (`summary.exposure`). Each rank's
node is torchrun's GROUP_RANK, gathered once.

The stamps are one clock only on one host: where the job's ranks are on several hosts (launcher.nnodes > 1
on real machines), nothing is gathered and no figure is made (`summary.straggler` says why).
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter, defaultdict
from contextlib import contextmanager

import torch.distributed as dist

from ddp_lab.arithmetic.skew import (
    aligned,
    exposure,
    exposure_table,
    node_stamps,
    step_evidence,
    step_figures,
    verdict,
)
from ddp_lab.spec.figures import FWD_BWD, SYNC
from ddp_lab.strategies.comm_stats import per_collective

MULTI_HOST = "the ranks are on several hosts, whose clocks differ: no skew is measured"
ONE_RANK = "one rank: nobody waits for anybody"
UNSTAMPED = "measure.per_collective=false: the collectives carry no stamps to compare"


class ArrivalWatch:
    """Per step: `drawing()` around the batch's draw, then `step(step, comm, timer, step_ms)` on every rank; at
    the end `verdict()` and `exposure()` on rank 0."""

    def __init__(self, warmup_steps: int):
        hosts = [None] * dist.get_world_size()
        # torchrun's GROUP_RANK: this rank's node (an emulated node is a node of one host)
        dist.all_gather_object(hosts, (socket.gethostname(), int(os.environ.get("GROUP_RANK", 0))))
        self.nodes = [node for _, node in hosts]
        self.why_not = (ONE_RANK if len(hosts) == 1 else MULTI_HOST if len({h for h, _ in hosts}) > 1
                        else None if per_collective() else UNSTAMPED)
        self.one_host = self.why_not is None  # and more than one rank: stamps to compare
        self.warmup_steps, self.rank = warmup_steps, dist.get_rank()
        self.steps: list[dict] = []
        self.exposed: dict[tuple, list] = defaultdict(list)  # per step shape (the collectives' bytes): its rows
        self.data_s = 0.0

    @contextmanager
    def drawing(self):
        """Time this rank's draw of the step's batch (a data cause of a straggler)."""
        start = time.perf_counter()
        yield
        self.data_s = time.perf_counter() - start

    def step(self, step: int, comm, timer, step_ms: float) -> dict:
        """This step's skew figures on rank 0 ({} elsewhere, or where the stamps do not match up). `comm`: the
        strategy's CommStats before its pop; `timer`: the StepTimer of the step."""
        if not self.one_host:
            return {}
        data_ms = self.data_s * 1e3
        window = (timer.marks.get(FWD_BWD.key), timer.marks.get(SYNC.key))
        mine = (list(comm.intervals), data_ms, timer.laps.get(FWD_BWD.key, 0.0) - data_ms, step_ms, window)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        stamps = [g[0] for g in gathered]
        if self.rank != 0 or not aligned(stamps):
            return {}
        if step >= self.warmup_steps:
            record = {**step_evidence(stamps), "step_ms": max(g[3] for g in gathered),
                      "phases": {"data": [g[1] for g in gathered], "compute": [g[2] for g in gathered]}}
            if len(set(self.nodes)) > 1:
                record |= {"nodes": self.nodes, "per_node": step_evidence(node_stamps(stamps, self.nodes))}
            self.steps.append(record)
            windows = [g[4] for g in gathered]
            if all(None not in w for w in windows):
                self.exposed[tuple(comm.sizes)].append(exposure(stamps, windows))
        return step_figures(stamps)

    def verdict(self) -> dict | None:
        """results.json's `summary.straggler` on rank 0 (the verdict of arithmetic/skew.py, or why there is
        none); None on the other ranks, which keep no steps."""
        if self.rank != 0:
            return None
        if not self.one_host:
            return {"rank": None, "why": self.why_not}
        return verdict(self.steps) or {"rank": None, "why": "no collective stamps matched across ranks"}

    def exposure(self) -> dict | None:
        """results.json's `summary.exposure` on rank 0: per collective of the most common step (by the bytes of
        its collectives), what the most exposed rank waited for after backward and why; None elsewhere."""
        if self.rank != 0 or not self.exposed:
            return None
        sizes, steps = max(self.exposed.items(), key=lambda item: len(item[1]))
        ranks = Counter(rank for rank, _ in steps)
        return {"rank": ranks.most_common(1)[0][0], "steps": len(steps),
                "per_collective": exposure_table([rows for _, rows in steps], list(sizes))}
