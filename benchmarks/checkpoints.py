"""What a checkpoint costs each strategy, and a run that moves between strategies (docs/benchmarks.md,
"Checkpoints").

1. The ladder (bucketed, zero1 in both modes, zero2, fsdp, hsdp, torch_ddp, zero1_torch, fsdp_torch) on the
   tiny Transformer and the built-in text at 2 and 4 ranks: 6 steps with a checkpoint after steps 3 and 6
   (`checkpoint_save_ms`, `checkpoint_bytes` per save, the folder's size on disk), then the same strategy
   and world size loading that job's newest checkpoint for 2 more steps (`summary.resumed_from.load_ms`).
2. The run of issue 34's "done when": fsdp at 2 ranks for 30 steps with a checkpoint every 10, bucketed at
   3 ranks going on from it to step 40, and fsdp at 2 ranks for 40 steps straight beside them: the loss
   curves, drawn to docs/img/checkpoint_continue.png.

    python benchmarks/checkpoints.py [OUT]        # default OUT: outputs/bench/checkpoints; about 10 minutes here
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ["data=text", "model=tiny", "logger=none", "train.eval_batches=0", "train.batch_size=12"]
LADDER = [("bucketed", []), ("zero1", []), ("zero1", ["strategy.comm=reduce_scatter"]), ("zero2", []),
          ("fsdp", []), ("hsdp", ["strategy.shard_size=2"]), ("torch_ddp", []), ("zero1_torch", []),
          ("fsdp_torch", [])]


def launch(*overrides: str) -> dict:
    subprocess.run([sys.executable, str(ROOT / "launch.py"), *overrides], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    run_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir="))
    return json.loads((Path(run_dir) / "results.json").read_text())


def size_on_disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def ladder(out: Path) -> list[dict]:
    rows = []
    for world_size in (2, 4):
        for strategy, knobs in LADDER:
            if strategy == "hsdp" and world_size == 2:
                continue  # one group of 2: fsdp's row
            label = "-".join([strategy, *[k.split("=")[1] for k in knobs]])
            job = out / "ladder" / f"{label}-{world_size}"
            saved = launch(*BASE, f"strategy={strategy}", *knobs, f"world_size={world_size}", "train.steps=6",
                           "train.warmup_steps=1", "checkpoint.every=3", f"hydra.run.dir={job}")
            saves = [s for s in saved["steps"] if "checkpoint_save_ms" in s]
            loaded = launch(*BASE, f"strategy={strategy}", *knobs, f"world_size={world_size}", "train.steps=8",
                            "train.warmup_steps=1", f"checkpoint.load={job}", f"hydra.run.dir={job}-load")
            rows.append({"strategy": label, "world_size": world_size,
                         "save_ms": [round(s["checkpoint_save_ms"], 1) for s in saves],
                         "bytes_per_rank": saves[-1]["checkpoint_bytes"],
                         "on_disk": size_on_disk(job / "checkpoints" / "step_6"),
                         "load_ms": round(loaded["summary"]["resumed_from"]["load_ms"], 1),
                         "step_p50_ms": round(saved["summary"]["step_time_ms"]["p50"], 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def continued(out: Path) -> dict:
    first = launch(*BASE, "strategy=fsdp", "train.steps=30", "checkpoint.every=10", f"hydra.run.dir={out}/fsdp-30")
    then = launch(*BASE, "strategy=bucketed", "world_size=3", f"checkpoint.load={out}/fsdp-30", "train.steps=40",
                  f"hydra.run.dir={out}/bucketed-3-from-30")
    straight = launch(*BASE, "strategy=fsdp", "train.steps=40", f"hydra.run.dir={out}/fsdp-40")
    curves = {name: [(s["step"], s["loss"]) for s in run["steps"]]
              for name, run in (("fsdp, 2 ranks, steps 0-29", first), ("bucketed, 3 ranks, from its step 30", then),
                                ("fsdp, 2 ranks, 40 steps straight", straight))}
    draw(curves, ROOT / "docs" / "img" / "checkpoint_continue.png")
    return curves


def draw(curves: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for (name, points), style in zip(curves.items(), ("-", "-", ":")):
        ax.plot([s for s, _ in points], [v for _, v in points], style, label=name, marker="." if style != ":" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("a checkpoint moved from fsdp@2 to bucketed@3 (tiny, text)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "outputs" / "bench" / "checkpoints").resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = ladder(out)
    curves = continued(out)
    (out / "checkpoints.json").write_text(json.dumps({"ladder": rows, "curves": curves}, indent=1))
    print("| strategy | ranks | save ms (after steps 3, 6) | MiB per rank (most) | on disk MiB | load ms | p50 ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        saves = " / ".join(map(str, r["save_ms"]))
        print(f"| {r['strategy']} | {r['world_size']} | {saves} | {r['bytes_per_rank'] / 2**20:.1f} | "
              f"{r['on_disk'] / 2**20:.1f} | {r['load_ms']} | {r['step_p50_ms']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
