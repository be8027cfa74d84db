"""Who is the straggler: ddp-lab's verdict and two published detectors graded against an injected slow rank
(docs/benchmarks.md, "Stragglers").

Each job trains the tiny Transformer at 4 ranks with one rank slowed (`fault.kind=slow`: its forward and
backward take `fault.slowdown` times as long, from step 1) for each strategy and slowdown; the slow rank is drawn at
random per job (seeded: the draw is printed and kept in each job's results.json, `summary.injected`). Clean jobs
(no fault) beside them must name no one. Each job's verdict (`summary.straggler`) is graded, and so are two
detectors run on the same stamps (ddp_lab/arithmetic/skew.py): traceml's published rule (the rank with the
shortest forward+backward, 10% impact) and HTA's late-start idea (the rank last at the most collectives).

    python benchmarks/stragglers.py [OUT] [--seed 0]      # 16 jobs, about 10 minutes here
    python benchmarks/stragglers.py [OUT] --clean 3       # 12 clean jobs: what chance makes the verdict say
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddp_lab.arithmetic.skew import late_start_rule, traceml_rule  # noqa: E402

STRATEGIES = ["bucketed", "zero2", "fsdp", "powersgd"]
SLOWDOWNS = [1.1, 1.3, 2.0]
RANKS = 4
BASE = ["model=tiny", "logger=none", f"world_size={RANKS}", "train.batch_size=8", "train.eval_batches=0"]
# train.steps and warmup_steps: the defaults (20, 3), so 17 measured steps, what a user's job gives the verdict


def run(out: Path, name: str, overrides: list[str]) -> dict:
    job = out / name
    subprocess.run([sys.executable, str(ROOT / "launch.py"), *BASE, *overrides, f"hydra.run.dir={job}"],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads((job / "results.json").read_text())


def grade(results: dict, truth: int | None) -> dict:
    found = results["summary"]["straggler"]
    named = {"ddp-lab": found["rank"],
             "traceml": traceml_rule(found) if "per_rank" in found else None,
             "late start": late_start_rule(found) if "per_rank" in found else None}
    return {name: rank == truth for name, rank in named.items()} | {"named": named}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="outputs/bench/stragglers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clean", type=int, default=0, metavar="N",
                        help="only clean jobs, N per strategy: what chance alone makes the verdict say")
    args = parser.parse_args()
    out, draw = Path(args.out), random.Random(args.seed)
    rows = []
    for strategy in STRATEGIES:
        jobs = ([(None, None)] + [(slowdown, draw.randrange(RANKS)) for slowdown in SLOWDOWNS] if not args.clean
                else [(None, None)] * args.clean)
        for slowdown, rank in jobs:
            fault = [] if slowdown is None else ["fault.kind=slow", f"fault.rank={rank}", "fault.step=1",
                                                 f"fault.slowdown={slowdown}"]
            name = f"{strategy}_{'clean' if slowdown is None else f'{slowdown}x_rank{rank}'}"
            name += f"_{sum(r['strategy'] == strategy for r in rows)}" if args.clean else ""
            results = run(out, name, [f"strategy={strategy}", *fault])
            graded = grade(results, rank)
            found = results["summary"]["straggler"]
            rows.append({"job": name, "strategy": strategy, "slowdown": slowdown or 1.0, "truth": rank, **graded,
                         "cost_ms": found.get("cost_ms"), "share": found.get("share"), "cause": found.get("cause"),
                         **{key: found.get(key) for key in ("held_share", "chance", "why")},
                         "evidence": {key: found["per_rank"][key] for key in ("blame_ms", "held", "last")},
                         "step_ms": results["summary"]["step_time_ms"]["p50"]})
            print(json.dumps(rows[-1]), flush=True)
    (out / "grades.json").write_text(json.dumps(rows, indent=1))
    print("\n| slowdown | jobs | ddp-lab | traceml's rule | late start (HTA) |\n|---|---|---|---|---|")
    for slowdown in [1.0, *SLOWDOWNS]:
        these = [r for r in rows if r["slowdown"] == slowdown]
        if not these:
            continue
        cells = [f"{sum(r[d] for r in these)}/{len(these)}" for d in ("ddp-lab", "traceml", "late start")]
        print(f"| {slowdown:g}x{' (clean: right = no one named)' if slowdown == 1.0 else ''} | {len(these)} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
