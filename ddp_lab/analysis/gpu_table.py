"""The GPU check's one table (benchmarks/gpu.sh): every job of its sweeps, one row per (model, strategy), each
step beside the floor's and torch's reference's, and the same strategy with its per-collective figures off.

    python -m ddp_lab.analysis.gpu_table OUT [OUT ...]        # prints Markdown; -o FILE writes it too

Columns, all p50 over the measured steps in ms unless said: step, forward+backward, optimizer, comm (in flight),
peak memory (CUDA's max_memory_allocated, MiB), × floor (the step over `strategy=none`'s, same model and batch),
× torch's (over the strategy's torch reference: bucketed's torch_ddp, zero2's zero1_torch, fsdp's fsdp_torch),
both compiled where the row is (`-compile=inductor`),
step with `measure.per_collective=false` and on ÷ off (what the stamps cost; for torch_ddp the lab's hooks
over torch's DDP bare). A job that failed shows its status in the step cell. Reads results.json only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddp_lab.analysis.columns import markdown
from ddp_lab.analysis.records import job_records, load_runs, per_collective_on
from ddp_lab.spec.labels import compile_label, knob_label

HEADER = ["model", "strategy", "step", "fwd+bwd", "optimizer", "comm", "peak MiB", "× floor", "× torch's",
          "step, figures off", "on ÷ off"]


def _fmt(value, spec: str = "{:.1f}") -> str:
    return "-" if value is None else spec.format(value)


def gpu_rows(roots: list[Path]) -> list[list[str]]:
    """The table's cells, rows in the order the jobs ran (the first sweep's first), figures-off jobs folded
    into their strategy's row."""
    runs = [(f"{root}/{name}", res) for root in roots for name, res, _ in load_runs(root)]
    records = job_records(runs)
    rows: dict[tuple, dict] = {}
    for rec, (_, res) in zip(records, runs):
        if rec["task"] != "train":
            continue
        cfg = res.get("config") or {}
        key = (rec["model"], knob_label(cfg["strategy"]) + compile_label(cfg) if cfg.get("strategy") else "?")
        row = rows.setdefault(key, {})
        row["on" if per_collective_on(res) else "off"] = rec
    out = []
    for (model, strategy), row in rows.items():
        on, off = row.get("on"), row.get("off")
        main = on or {"status": "-"}  # a strategy measured with its figures off only: those cells stay empty
        ok = main["status"] == "ok"
        step = main.get("step_p50_ms") if ok else None
        off_step = off.get("step_p50_ms") if off and off["status"] == "ok" else None
        ratio = on["step_p50_ms"] / off_step if on and on["status"] == "ok" and off_step else None
        out.append([model, strategy, _fmt(step) if ok else main["status"], _fmt(main.get("fwd_bwd_p50_ms")),
                    _fmt(main.get("optimizer_p50_ms")), _fmt(main.get("comm_p50_ms")),
                    _fmt(main.get("max_memory_allocated_mib"), "{:.0f}"), _fmt(main.get("vs_floor"), "{:.2f}"),
                    _fmt(main.get("vs_torch"), "{:.2f}"),
                    _fmt(off_step) if off is None or off["status"] == "ok" else off["status"],
                    _fmt(ratio, "{:.3f}")])
    return out


def gpu_table(roots: list[Path]) -> str:
    return markdown(HEADER, gpu_rows(roots))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_lab.analysis.gpu_table", description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", type=Path, help="the GPU check's sweep folders")
    parser.add_argument("-o", "--output", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.sweeps if not p.is_dir()]
    if missing:
        print(f"error: no such folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    text = gpu_table(args.sweeps)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
