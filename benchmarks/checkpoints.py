"""What a checkpoint costs each strategy, and a run that moves between strategies (docs/benchmarks.md,
"Checkpoints").

1. The ladder (bucketed, zero1 in both modes, zero2, fsdp, hsdp, torch_ddp, zero1_torch, fsdp_torch) at 2 and
   4 ranks, on the tiny Transformer and the built-in text, and on the small one (Table 1, 128.6M parameters,
   synthetic tokens): a run with a checkpoint every `every` steps (`checkpoint_save_ms`, `checkpoint_bytes`,
   `checkpoint_extra_bytes` per save, the folder's size on disk), the same strategy and world size loading
   that job's newest checkpoint for a few more steps (`summary.resumed_from.load_ms`), and on tiny the first
   run again with `checkpoint.async_save=true` (the loop's wait for the first save, its memory, and the
   steps that ran while it was written against the same steps of the blocking run).
2. The run of issue 34's "done when": fsdp at 2 ranks for 30 steps with a checkpoint every 10, bucketed at
   3 ranks going on from it to step 40, and fsdp at 2 ranks for 40 steps straight beside them: the loss
   curves, drawn to docs/img/checkpoint_continue.png.

    python benchmarks/checkpoints.py [OUT] [--models tiny,small] [--no-continued]   # about 65 minutes here
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ["data=text", "model=tiny", "logger=none", "train.eval_batches=0", "train.batch_size=12"]
MODELS = {  # the overrides of each model's ladder, its steps, a checkpoint every `every`, and the async run
    "tiny": {"base": BASE, "steps": 6, "every": 3, "async": True},
    "small": {"base": ["model=small", "logger=none", "train.batch_size=4"], "steps": 4, "every": 2, "async": False},
}
LADDER = [("bucketed", []), ("zero1", []), ("zero1", ["strategy.comm=reduce_scatter"]), ("zero2", []),
          ("fsdp", []), ("hsdp", ["strategy.shard_size=2"]), ("torch_ddp", []), ("zero1_torch", []),
          ("fsdp_torch", [])]
MiB = 2**20


def launch(*overrides: str) -> dict:
    subprocess.run([sys.executable, str(ROOT / "launch.py"), *overrides], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    run_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir="))
    return json.loads((Path(run_dir) / "results.json").read_text())


def size_on_disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def ladder(out: Path, model: str) -> list[dict]:
    m = MODELS[model]
    steps, every = m["steps"], m["every"]
    rows = []
    for world_size in (2, 4):
        for strategy, knobs in LADDER:
            if strategy == "hsdp" and world_size == 2:
                continue  # one group of 2: fsdp's row
            label = "-".join([strategy, *[k.split("=")[1] for k in knobs]])
            job = out / model / f"{label}-{world_size}"
            run = [*m["base"], f"strategy={strategy}", *knobs, f"world_size={world_size}", "train.warmup_steps=1"]
            saved = launch(*run, f"train.steps={steps}", f"checkpoint.every={every}", f"hydra.run.dir={job}")
            saves = [s for s in saved["steps"] if "checkpoint_save_ms" in s]
            loaded = launch(*run, f"train.steps={steps + 2}", f"checkpoint.load={job}", f"hydra.run.dir={job}-load")
            row = {"model": model, "strategy": label, "world_size": world_size,
                   "save_ms": [round(s["checkpoint_save_ms"], 1) for s in saves],
                   "bytes_per_rank": saves[-1]["checkpoint_bytes"],
                   "extra_bytes": max(s.get("checkpoint_extra_bytes", 0) for s in saves),
                   "on_disk": size_on_disk(job / "checkpoints" / f"step_{steps}"),
                   "load_ms": round(loaded["summary"]["resumed_from"]["load_ms"], 1),
                   "step_p50_ms": round(saved["summary"]["step_time_ms"]["p50"], 1)}
            if m["async"]:
                background = launch(*run, f"train.steps={steps}", f"checkpoint.every={every}",
                                    "checkpoint.async_save=true", f"hydra.run.dir={job}-async")
                first = background["steps"][every - 1]
                writing = range(every, 2 * every - 1)  # the steps after the first save, before the next one
                row.update({"async_wait_ms": round(first["checkpoint_save_ms"], 1),
                            "async_extra_bytes": first.get("checkpoint_extra_bytes", 0),
                            "async_staged_bytes": first["checkpoint_staged_bytes"],
                            "async_writing_step_ms": _mean_step(background, writing),
                            "blocking_same_steps_ms": _mean_step(saved, writing)})
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _mean_step(record: dict, steps: range) -> float:
    return round(statistics.mean(s["step_time_ms"] for s in record["steps"] if s["step"] in steps), 1)


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


def table(rows: list[dict]) -> str:
    lines = ["| model | strategy | ranks | save ms (each) | MiB per rank (most) | extra MiB (peak) | on disk MiB | "
             "load ms | p50 ms |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['strategy']} | {r['world_size']} | {' / '.join(map(str, r['save_ms']))} | "
              f"{r['bytes_per_rank'] / MiB:.1f} | {r['extra_bytes'] / MiB:.1f} | {r['on_disk'] / MiB:.1f} | "
              f"{r['load_ms']} | {r['step_p50_ms']} |" for r in rows]
    timed = [r for r in rows if "async_wait_ms" in r]
    if timed:
        lines += ["", "| model | strategy | ranks | blocking save ms | async wait ms | staged MiB | async extra MiB | "
                  "steps while writing ms | the same steps, blocking run ms |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['strategy']} | {r['world_size']} | {r['save_ms'][0]} | {r['async_wait_ms']} | "
                  f"{r['async_staged_bytes'] / MiB:.1f} | {r['async_extra_bytes'] / MiB:.1f} | "
                  f"{r['async_writing_step_ms']} | {r['blocking_same_steps_ms']} |" for r in timed]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(ROOT / "outputs" / "bench" / "checkpoints"))
    parser.add_argument("--models", default="tiny,small", help="the ladders to run: tiny, small or both")
    parser.add_argument("--no-continued", action="store_true", help="skip part 2 (the picture)")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = [row for model in args.models.split(",") for row in ladder(out, model)]
    curves = None if args.no_continued else continued(out)
    (out / "checkpoints.json").write_text(json.dumps({"ladder": rows, "curves": curves}, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
