"""The low-bandwidth methods over slow links (docs/benchmarks.md, "The low-bandwidth methods of 2025-26").

2 emulated nodes x 2 ranks (needs root), the tiny Transformer on the built-in text, 96 steps, the validation
loss every 16 steps (4 held-out batches), one rank per node's link at: unshaped, 1 Gbit/s, 0.1 Gbit/s. The
methods, each a row: bucketed fp32 and bf16 on the wire, powersgd (rank 4), DiLoCo (local_sgd every 16 steps,
outer Nesterov), streaming DiLoCo (the same in 4 fragments, each all-reduce launched a step early), MuLoCo
(DiLoCo with train.optimizer=muon), DeMo (defaults: top 32 of each 64 x 64 block), SparseLoCo (every 16 steps,
the top 64 of each 64 x 64 block of the pseudo-gradient, 2-bit values, error feedback). At 1 Gbit/s also one
straggler row per method (rank 1's compute 1.3x from step 2). Per job: mean step time, mean and peak bytes
per step (comm_bytes: what is handed to the collectives), final validation loss, and the time to reach a
target validation loss (bucketed fp32's final one on the same link, + 2% and + 10%; "-" where never reached).

The long curves: each method again for 320 steps at seeds 0 and 1, unshaped. The validation loss does not
depend on the link (the runs are deterministic: the 96-step table's losses are equal on every link, and
seed 0's first 96 steps here equal them), so the time to a target on a link is the steps to it times the
method's mean step time on that link from the 96-step table.

    python benchmarks/low_bandwidth_study.py [OUT]              # about 65 minutes here
    python benchmarks/low_bandwidth_study.py OUT --table-only   # the table and the picture again, from OUT
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVAL_EVERY = 96, 16
LONG_STEPS, SEEDS = 320, (0, 1)
BASE = ["network=emulated", "network.nodes=2", "world_size=4", "data=text", "model=tiny", "train.warmup_steps=4",
        "train.batch_size=8", f"train.eval_every={EVAL_EVERY}", "logger=none"]
DILOCO = ["strategy=local_sgd", "strategy.sync_every=16", "strategy.outer=nesterov"]
METHODS = {
    "bucketed fp32": ["strategy=bucketed"],
    "bucketed bf16": ["strategy=bucketed", "strategy.comm_dtype=bf16"],
    "powersgd r4": ["strategy=powersgd", "strategy.rank=4", "strategy.start_iter=4"],
    "DiLoCo H=16": DILOCO,
    "streaming DiLoCo F=4 tau=1": [*DILOCO, "strategy.fragments=4", "strategy.delay=1"],
    "MuLoCo H=16": [*DILOCO, "train.optimizer=muon"],
    "DeMo": ["strategy=demo"],
    "SparseLoCo H=16 k=64": ["strategy=local_sgd", "strategy.sync_every=16", "strategy.outer_topk=64"],
}
LINKS = {"unshaped": [], "1 Gbit/s": ["network.gbps=1"], "0.1 Gbit/s": ["network.gbps=0.1"]}
STRAGGLER = ["fault.kind=slow", "fault.rank=1", "fault.step=2", "fault.slowdown=1.3"]
TARGETS = (1.02, 1.10)  # bucketed fp32's final validation loss on the same link, times these


def job(out: Path, name: str, *overrides: str) -> None:
    if (out / name / "results.json").exists():
        return  # done by an earlier, interrupted run of this script
    subprocess.run([sys.executable, str(ROOT / "launch.py"), *BASE, *overrides, f"hydra.run.dir={out / name}"],
                   cwd=ROOT, stdout=subprocess.DEVNULL, check=False)  # a failed job is a row, not the end


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)


def row(path: Path) -> dict:
    res = json.loads(path.read_text())
    summary, steps = res.get("summary") or {}, res.get("steps") or []
    measured = [s for s in steps if s["step"] >= res["config"]["train"]["warmup_steps"]]
    return {"status": res["status"], "step_ms": (summary.get("step_time_ms") or {}).get("mean"),
            "mean_bytes": summary.get("comm_bytes_per_step"),
            "peak_bytes": max((s["comm_bytes"] for s in measured), default=None),
            "val_loss": summary.get("final_val_loss"),
            "curve": [(sum(x["step_time_ms"] for x in steps[:i + 1]) / 1e3, s["val_loss"])
                      for i, s in enumerate(steps) if "val_loss" in s],
            "by_step": [(s["step"] + 1, s["val_loss"]) for s in steps if "val_loss" in s]}


def time_to(curve: list, target: float | None):
    """Seconds of training until the validation loss first reaches `target` (None: never)."""
    if target is None:
        return None
    return next((t for t, loss in curve if loss <= target), None)


def table(out: Path) -> dict:
    found = {}
    for link in LINKS:
        for method in METHODS:
            for kind in ("clean", "straggler"):
                path = out / slug(f"{link} {method} {kind}") / "results.json"
                if path.exists():
                    found[link, method, kind] = row(path)
    for method in METHODS:
        for seed in SEEDS:
            path = out / slug(f"long {method} seed {seed}") / "results.json"
            if path.exists():
                found["long", method, f"seed {seed}"] = row(path)
    return found


def picture(found: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.8))
    for method in METHODS:
        xs = [i for i, link in enumerate(LINKS) if (link, method, "clean") in found]
        line = left.plot(xs, [found[list(LINKS)[i], method, "clean"]["step_ms"] for i in xs], marker="o",
                         label=method)[0]
        slow_ms = found.get(("0.1 Gbit/s", method, "clean"), {}).get("step_ms")
        for seed, style in zip(SEEDS, ("-", ":")):
            curve = found.get(("long", method, f"seed {seed}"), {}).get("by_step") or []
            middle.plot([n for n, _ in curve], [loss for _, loss in curve], style, color=line.get_color())
            if slow_ms and seed == SEEDS[0]:
                right.plot([n * slow_ms / 1e3 for n, _ in curve], [loss for _, loss in curve], style,
                           color=line.get_color(), label=method)
    left.set_xticks(range(len(LINKS)), list(LINKS))
    left.set_yscale("log")
    left.set_ylabel("mean step time (ms, log)")
    left.set_title("Step time by link (2 emulated nodes x 2 ranks, tiny, text)", fontsize=9)
    left.legend(fontsize=7)
    middle.set_xlabel("step")
    middle.set_ylabel("validation loss")
    middle.set_title(f"Validation loss by step ({LONG_STEPS} steps; seed {SEEDS[0]} solid, {SEEDS[1]} dotted)",
                     fontsize=9)
    right.set_xscale("log")
    right.set_xlabel("training seconds at 0.1 Gbit/s (steps x that link's mean step time; log)")
    right.set_ylabel("validation loss")
    right.set_title(f"Validation loss against time at 0.1 Gbit/s (seed {SEEDS[0]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--table-only"]
    out = Path(args[0] if args else "outputs/bench/low_bandwidth_study")
    if "--table-only" not in sys.argv:
        for link, shape in LINKS.items():
            for method, knobs in METHODS.items():
                job(out, slug(f"{link} {method} clean"), *shape, *knobs, f"train.steps={STEPS}")
        for method, knobs in METHODS.items():
            job(out, slug(f"1 Gbit/s {method} straggler"), *LINKS["1 Gbit/s"], *knobs, *STRAGGLER,
                f"train.steps={STEPS}")
        for seed in SEEDS:
            for method, knobs in METHODS.items():
                job(out, slug(f"long {method} seed {seed}"), *knobs, f"train.steps={LONG_STEPS}",
                    f"train.seed={seed}")
    found = table(out)
    (out / "study.json").write_text(json.dumps({" | ".join(k): v for k, v in found.items()}, indent=1))
    picture(found, ROOT / "docs" / "img" / "low_bandwidth_study.png")
    print("| link | method | mean step ms | mean MiB/step | peak MiB/step | final val loss | s to +2% | s to +10% | "
          "step ms, rank 1 at 1.3x |\n|---|---|---|---|---|---|---|---|---|")
    for link in LINKS:
        reference = found.get((link, "bucketed fp32", "clean"), {}).get("val_loss")
        targets = [reference * t if reference else None for t in TARGETS]
        for method in METHODS:
            r = found.get((link, method, "clean"))
            if r is None:
                continue
            slow = found.get((link, method, "straggler"), {}).get("step_ms")
            cells = [_num(r["step_ms"], 0), _num(r["mean_bytes"] and r["mean_bytes"] / 2**20, 2),
                     _num(r["peak_bytes"] and r["peak_bytes"] / 2**20, 2), _num(r["val_loss"], 3),
                     *[_num(time_to(r["curve"], t), 1) for t in targets], _num(slow, 0)]
            status = "" if r["status"] == "ok" else f" ({r['status']})"
            print(f"| {link} | {method}{status} | " + " | ".join(cells) + " |")
        print(f"| {link} | targets | | | | {' / '.join(_num(t, 3) for t in targets)} | | | |")
    long_table(found)


def long_table(found: dict) -> None:
    """The 320-step curves: the loss by seed, the steps to bucketed fp32's final loss + 2% / + 10% of the same
    seed, and the seconds that is on each link (steps x the method's mean step time there, 96-step table)."""
    finals = {seed: found.get(("long", "bucketed fp32", f"seed {seed}"), {}).get("val_loss") for seed in SEEDS}
    seeds = " / ".join(str(seed) for seed in SEEDS)
    print(f"\n| method | val loss at {STEPS} / {LONG_STEPS} steps, seed {seeds} | "
          + " | ".join(f"steps to +{round((t - 1) * 100)}%, seed {seeds}" for t in TARGETS) + " | "
          + " | ".join(f"s to +{round((t - 1) * 100)}% at {link}, seed {seeds}" for t in TARGETS for link in LINKS)
          + " |\n|---|---|" + "---|" * len(TARGETS) * (1 + len(LINKS)))
    for method in METHODS:
        runs = [found.get(("long", method, f"seed {seed}")) for seed in SEEDS]
        if not any(runs):
            continue
        losses = [" / ".join(_num(_loss_at(r, n), 3) for n in (STEPS, LONG_STEPS)) for r in runs]
        reached = {t: [_steps_to(r, finals[seed] and finals[seed] * t) for r, seed in zip(runs, SEEDS)]
                   for t in TARGETS}
        cells = ["; ".join(losses)]
        cells += [" / ".join(_num(n, 0) for n in reached[t]) for t in TARGETS]
        for t in TARGETS:
            for link in LINKS:
                ms = found.get((link, method, "clean"), {}).get("step_ms")
                cells.append(" / ".join(_num(n and ms and n * ms / 1e3, 0) for n in reached[t]))
        print(f"| {method} | " + " | ".join(cells) + " |")
    print("| targets | | " + " | ".join(" / ".join(_num(finals[s] and finals[s] * t, 3) for s in SEEDS)
                                       for t in TARGETS) + " |" + " |" * len(TARGETS) * len(LINKS))


def _loss_at(run: dict | None, step: int):
    return next((loss for n, loss in (run or {}).get("by_step", []) if n == step), None)


def _steps_to(run: dict | None, target: float | None):
    """Steps until the validation loss first reaches `target` (None: never, or no run)."""
    return time_to((run or {}).get("by_step", []), target)


def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    main()
