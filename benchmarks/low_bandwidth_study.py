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

    python benchmarks/low_bandwidth_study.py [OUT]              # about 45 minutes here
    python benchmarks/low_bandwidth_study.py OUT --table-only   # the table and the picture again, from OUT
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVAL_EVERY = 96, 16
BASE = ["network=emulated", "network.nodes=2", "world_size=4", "data=text", "model=tiny", f"train.steps={STEPS}",
        "train.warmup_steps=4", "train.batch_size=8", f"train.eval_every={EVAL_EVERY}", "logger=none"]
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
                      for i, s in enumerate(steps) if "val_loss" in s]}


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
    return found


def picture(found: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for method in METHODS:
        xs = [i for i, link in enumerate(LINKS) if (link, method, "clean") in found]
        left.plot(xs, [found[list(LINKS)[i], method, "clean"]["step_ms"] for i in xs], marker="o", label=method)
        curve = found.get(("1 Gbit/s", method, "clean"), {}).get("curve") or []
        right.plot([t for t, _ in curve], [loss for _, loss in curve], marker=".", label=method)
    left.set_xticks(range(len(LINKS)), list(LINKS))
    left.set_yscale("log")
    left.set_ylabel("mean step time (ms, log)")
    left.set_title("Step time by link (2 emulated nodes x 2 ranks, tiny, text)")
    right.set_xlabel("training seconds at 1 Gbit/s")
    right.set_ylabel("validation loss")
    right.set_title(f"Validation loss against time, 1 Gbit/s ({STEPS} steps)")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--table-only"]
    out = Path(args[0] if args else "outputs/bench/low_bandwidth_study")
    if "--table-only" not in sys.argv:
        for link, shape in LINKS.items():
            for method, knobs in METHODS.items():
                job(out, slug(f"{link} {method} clean"), *shape, *knobs)
        for method, knobs in METHODS.items():
            job(out, slug(f"1 Gbit/s {method} straggler"), *LINKS["1 Gbit/s"], *knobs, *STRAGGLER)
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


def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    main()
