"""Which strategy tolerates a straggler, and at what loss (docs/benchmarks.md, "Stragglers").

2 emulated nodes x 2 ranks joined at 1 Gbit/s (needs root), the tiny Transformer on the built-in text, 32 steps:
bucketed, zero2, fsdp, powersgd and local SGD (every 4 and 16 steps, with and without the outer Nesterov step),
each clean, with rank 1 slowed 1.1x, 1.3x and 2x from step 2 (`fault.kind=slow`), clean with node 1's link
at 0.25 Gbit/s (`network.slow_node`), and clean with that link turning slow at step 16 (`network.slow_step`).
One Hydra sweep per row kind; the table (mean step time: local SGD's median step has no communication; the
final validation loss; the verdicts) is printed and the picture written to docs/img/straggler_study.png.

    python benchmarks/straggler_study.py [OUT]                # about 25 minutes here
    python benchmarks/straggler_study.py OUT --table-only     # the table and the picture again, from OUT
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ddp_lab.analysis.records import straggler_text  # noqa: E402

BASE = ["network=emulated", "network.nodes=2", "network.gbps=1", "world_size=4", "data=text", "model=tiny",
        "train.steps=32", "train.warmup_steps=4", "train.batch_size=8", "logger=none"]
STRATEGIES = [("bucketed", []), ("zero2", []), ("fsdp", []), ("powersgd", []),
              ("local_sgd", ["strategy.sync_every=4,16", "strategy.outer=none,nesterov"])]
SLOWDOWNS = [1.1, 1.3, 2.0]
SLOW_LINK = ["network.slow_node=1", "network.slow_gbps=0.25"]
LINK_STEP = 16  # the step the link turns slow at, in the last kind of row


def sweep(out: Path, name: str, *overrides: str) -> None:
    subprocess.run([sys.executable, str(ROOT / "launch.py"), "-m", *BASE, *overrides, f"hydra.sweep.dir={out / name}"],
                   cwd=ROOT, stdout=subprocess.DEVNULL, check=False)  # a failed job is a row, not the end


def rows(out: Path) -> list[dict]:
    found = []
    for path in sorted(out.glob("*/*/results.json")):
        res = json.loads(path.read_text())
        cfg, summary = res["config"], res.get("summary") or {}
        strategy = cfg["strategy"]["name"]
        if strategy == "local_sgd":
            strategy += f" H={cfg['strategy']['sync_every']} {cfg['strategy']['outer']}"
        fault, net = cfg["fault"], cfg["network"]
        slowdown = float(fault["slowdown"]) if fault["kind"] == "slow" else 1.0
        straggler = summary.get("straggler") or {}
        link = "none" if net.get("slow_gbps") is None else "from step" if net.get("slow_step") else "whole run"
        made = (summary.get("injected_link") or {}).get("made_in_step")
        times = [(s["step"], s["step_time_ms"]) for s in res.get("steps") or [] if s["step"] >= 4]
        found.append({"strategy": strategy, "slowdown": slowdown, "slow_link": link,
                      "status": res["status"], "step_ms": (summary.get("step_time_ms") or {}).get("mean"),
                      "val_loss": summary.get("final_val_loss"), "named": straggler.get("rank"),
                      "verdict": straggler_text(straggler), "cost_ms": straggler.get("cost_ms"),
                      "skew_ms": (summary.get("skew_ms") or {}).get("p50"),
                      "before_ms": _mean([t for step, t in times if made is not None and step < made]),
                      "after_ms": _mean([t for step, t in times if made is not None and step > made])})
    return found


def _mean(values: list[float]) -> float | None:
    return mean(values) if values else None


def picture(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for strategy in dict.fromkeys(r["strategy"] for r in table):
        points = sorted((r["slowdown"], r["step_ms"]) for r in table
                        if r["strategy"] == strategy and r["slow_link"] == "none" and r["step_ms"])
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=strategy)
    ax.set_xlabel("rank 1's compute slowdown (x)")
    ax.set_ylabel("mean step time (ms)")
    ax.set_title("A straggler on 2 emulated nodes x 2 ranks at 1 Gbit/s (tiny, text)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--table-only"]
    out = Path(args[0] if args else "outputs/bench/straggler_study")
    for name, knobs in [] if "--table-only" in sys.argv else STRATEGIES:
        sweep(out, f"{name}_clean", f"strategy={name}", *knobs)
        sweep(out, f"{name}_slow", f"strategy={name}", *knobs, "fault.kind=slow", "fault.rank=1", "fault.step=2",
              "fault.slowdown=" + ",".join(map(str, SLOWDOWNS)))
        sweep(out, f"{name}_slow_link", f"strategy={name}", *knobs, *SLOW_LINK)
        sweep(out, f"{name}_slow_link_from_{LINK_STEP}", f"strategy={name}", *knobs, *SLOW_LINK,
              f"network.slow_step={LINK_STEP}")
    table = rows(out)
    (out / "study.json").write_text(json.dumps(table, indent=1))
    picture(table, ROOT / "docs" / "img" / "straggler_study.png")
    print("| strategy | clean ms | 1.1x | 1.3x | 2x | node 1's link at 0.25 Gbit/s | val loss | verdict, 1.3x "
          f"| verdict, 2x | verdict, slow link | link slow from step {LINK_STEP}: ms before / after | verdict |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")
    for strategy in dict.fromkeys(r["strategy"] for r in table):
        at = {(r["slowdown"], r["slow_link"]): r for r in table if r["strategy"] == strategy}
        verdicts = [at.get(key, {}).get("verdict") or "-" for key in ((1.3, "none"), (2.0, "none"),
                                                                       (1.0, "whole run"), (1.0, "from step"))]
        print(f"| {strategy} | {_cell(at, (1.0, 'none'))} | {_cell(at, (1.1, 'none'))} | "
              f"{_cell(at, (1.3, 'none'))} | {_cell(at, (2.0, 'none'))} | {_cell(at, (1.0, 'whole run'))} | "
              f"{_cell(at, (1.0, 'none'), 'val_loss')} | {' | '.join(verdicts[:3])} | "
              f"{_cell(at, (1.0, 'from step'), 'before_ms')} / {_cell(at, (1.0, 'from step'), 'after_ms')} | "
              f"{verdicts[3]} |")


def _cell(at: dict, key: tuple, figure: str = "step_ms") -> str:
    value = at.get(key, {}).get(figure)
    return "-" if value is None else f"{value:.3f}" if figure == "val_loss" else f"{value:.0f}"


if __name__ == "__main__":
    main()
