"""The parallelism overview's table, measured on one model: DP, PP, TP, DP+PP, DP+TP, PP+TP at world size 4
(DP+PP+TP at 8 with --three-d), and one rank alone as the yardstick, each a job through launch.py.

Per row: step p50 (the slowest rank), forward and backward per rank and its efficiency (one rank's forward and
backward of the whole batch over N, against the row's), parameters, gradients, AdamW state and activations per
rank (the largest rank), bytes per step per axis (dp: the strategy's collectives, tp: TP's, pp: the most a stage
sent), and the bubble beside its formula. Forward and backward per rank: a pipeline stage's actions (busy, its idle
left out), else the step's forward and backward phase; both with tensor parallelism's collectives inside them
(blocking, and on shared cores a rank waiting in one is waiting for its peers' compute: they cannot be told apart
here). With N ranks on C cores a rank computes at best C/N as fast as alone: the efficiency's ceiling is
min(1, C/N).

    python benchmarks/parallelism_overview.py [OUT] [--three-d]     # default OUT: outputs/bench/parallelism

Runs one job at a time; time nothing else while it runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ddp_lab.analysis.records import job_records
from ddp_lab.jobdir import read_results

ROOT = Path(__file__).resolve().parents[1]

COMMON = ["model=tiny", "strategy=bucketed", "logger=none", "train.steps=20"]
PIPE = ["parallel.pp_schedule=1f1b", "parallel.microbatches=4"]
ROWS = {
    "1 rank": ["world_size=1"],
    "DP": ["world_size=4"],
    "PP": ["world_size=4", "parallel.pp=4", *PIPE],
    "TP": ["world_size=4", "parallel.tp=4"],
    "DP+PP": ["world_size=4", "parallel.pp=2", *PIPE],
    "DP+TP": ["world_size=4", "parallel.tp=2"],
    "PP+TP": ["world_size=4", "parallel.pp=2", "parallel.tp=2", *PIPE],
}
THREE_D = {"DP+PP+TP": ["world_size=8", "parallel.pp=2", "parallel.tp=2", *PIPE]}


def compute_ms(res: dict) -> float:
    """A rank's forward and backward in a step (module docstring), mean over the measured steps."""
    pipeline = (res["summary"].get("mesh") or {}).get("pipeline")
    if pipeline:
        return sum(s["busy_ms"] for s in pipeline["per_stage"]) / len(pipeline["per_stage"])
    return res["summary"]["fwd_bwd_ms"]["mean"]


def main(argv: list[str]) -> int:
    out = Path(next((a for a in argv if not a.startswith("--")), ROOT / "outputs" / "bench" / "parallelism"))
    rows = {**ROWS, **(THREE_D if "--three-d" in argv else {})}
    for name, overrides in rows.items():
        job = out / name.replace("+", "_").replace(" ", "_")
        if not (job / "results.json").exists():
            cmd = [sys.executable, str(ROOT / "launch.py"), *COMMON, *overrides, f"hydra.run.dir={job}"]
            print(" ".join(cmd[1:]), flush=True)
            if subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True).returncode != 0:
                print(f"{name}: failed, see {job}/launch.log", file=sys.stderr)
                return 1
    results = {name: read_results(out / name.replace("+", "_").replace(" ", "_")) for name in rows}
    records = {name: job_records([(name, res)])[0] for name, res in results.items()}
    one = compute_ms(results["1 rank"])
    cores = os.cpu_count()
    print("| row | mesh dp x tp x pp | step ms | fwd+bwd ms/rank | compute efficiency (ceiling) | "
          "params + grads + AdamW MiB/rank | activations MiB/rank | dp MiB/step | tp MiB/step | pp MiB/step | "
          "bubble % (formula) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, res in results.items():
        r, world = records[name], res["config"]["world_size"]
        compute = compute_ms(res)
        bubble = "-" if r.get("bubble_pct") is None else f"{r['bubble_pct']:.1f} ({r['bubble_schedule_pct']:.1f})"
        efficiency = f"{one / world / compute:.2f} ({min(1, cores / world):.2f})"
        cells = [name, r["mesh"], f"{r['step_p50_ms']:.1f}", f"{compute:.1f}", efficiency,
                 f"{r['params_mib_per_rank']:.1f} + {r['grads_mib_per_rank']:.1f} + {r['opt_mib_per_rank']:.1f}",
                 _f(r.get("activations_mib_per_rank")), _f(r.get("comm_mib_per_step"), "{:.2f}"),
                 _f(r.get("tp_comm_mib_per_step"), "{:.2f}"), _f(r.get("p2p_mib_per_step"), "{:.2f}"), bubble]
        print("| " + " | ".join(cells) + " |")
    losses = {name: r["final_loss"] for name, r in records.items()}
    print("\nfinal loss: " + ", ".join(f"{n} {v:.4f}" for n, v in losses.items()))
    return 0


def _f(value, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
