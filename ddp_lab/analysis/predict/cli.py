"""`python -m ddp_lab.predict`: fit a step-time model, check it against a sweep, carry it to big systems.

    python -m ddp_lab.predict fit COLLECTIVE_SWEEP PROFILED_RUN -o model.json
    python -m ddp_lab.predict validate model.json SWEEP [--markdown table.md]
    python -m ddp_lab.predict scale --system h100-nvlink --model xl --world-size 8,64,512 --strategy bucketed,zero1,fsdp
    python -m ddp_lab.predict scale --system v100-dgx1 --model my_model.json --world-size 8,16 --strategy torch_ddp
    python -m ddp_lab.predict scale --system h200 --model xl --batch 32 --world-size 1,8,64   # compute measured
    python -m ddp_lab.predict record SWEEP [--table FILE]   # a GPU sweep's floor jobs into the measured table
    python -m ddp_lab.predict published [--markdown published.md]
    python -m ddp_lab.predict heldout OUT [--markdown heldout.md]     # after benchmarks/predict_heldout.sh OUT

Bad input (no collective benchmark or no profiled run in a folder, an unknown system or model, a
world size below 1) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from ddp_lab.analysis.predict import fit as fitting
from ddp_lab.analysis.predict import heldout as holding_out
from ddp_lab.analysis.predict import measured as measuring
from ddp_lab.analysis.predict import published as publishing
from ddp_lab.analysis.predict import scale as scaling
from ddp_lab.analysis.predict import validate as validating
from ddp_lab.analysis.predict.costs import PredictError
from ddp_lab.analysis.predict.systems import SYSTEMS, get_system
from ddp_lab.jobdir import ResultsSchemaError
from ddp_lab.spec.figures import FWD_BWD, OPTIMIZER


def cmd_fit(args) -> int:
    for path in (args.collective_sweep, args.profiled_run):
        if not Path(path).exists():
            raise PredictError(f"no such folder: {path}")
    model = fitting.fit(args.collective_sweep, args.profiled_run)
    fitting.save(model, args.output)
    c, k = model["compute"], model["contention"]
    print("collectives: " + ", ".join(
        f"{b}/{op}/{dt} at {sorted(e['by_world_size'], key=int)} ranks"
        + (f" (back to back at {sorted(e['back_to_back']['by_world_size'], key=int)})" if "back_to_back" in e else "")
        for b, ops in model["collectives"].items() for op, dts in ops.items() for dt, e in dts.items()))
    print(f"compute ({c['model']}, {c['strategy']}, {c['world_size']} ranks, {c['samples']} steps): forward "
          f"{c['forward_ms']:.1f} ms, backward {c['backward_ms']:.1f} ms of work, optimizer {c['optimizer_ms']:.1f} ms")
    print(f"cores: {c['cpus']:g} for {c['world_size']} ranks: compute x{k['compute_slowdown']:.2f} and comm "
          f"x{k['comm_slowdown']:.2f} slower while both run, {k.get('launch_ms', 0.0):.2f} ms of compute per "
          f"collective launched from backward ({k['identified_by'].split(':')[0]})")
    print(f"wrote {args.output}")
    return 0


def cmd_validate(args) -> int:
    model = fitting.load(args.model)
    if not Path(args.sweep).exists():
        raise PredictError(f"no such folder: {args.sweep}")
    rows, notes = validating.predict_records(model, args.sweep)
    if not rows:
        raise PredictError(f"no finished training job under {args.sweep} the model can replay")
    checks = validating.bucket_checks(model, rows)
    print(validating.text_table(rows))
    for note in notes:
        print(f"note: {note}")
    if args.markdown:
        Path(args.markdown).write_text(validating.markdown(rows, checks, notes) + "\n")
        print(f"wrote {args.markdown}")
    print("\n".join(validating.summary_lines(rows, checks)))
    return 0


def cmd_scale(args) -> int:
    system = get_system(args.system)
    model = scaling.load_model(args.model, args.context)
    sizes = scaling.world_sizes_arg(args.world_size)
    strategies = [s for s in args.strategy.split(",") if s]
    if args.mfu is not None:  # a what-if: the assumption at this MFU, no measured table
        if not 0 < args.mfu <= 1:
            raise PredictError(f"--mfu must be in (0, 1], got {args.mfu:g}")
        system, table = replace(system, mfu=args.mfu), []
    else:
        table = measuring.load_table(args.compute_table)
    work = scaling.workload(system, model, args.batch, table, args.compile)
    rows = scaling.scale_rows(system, work, sizes, strategies, args.batch, tp=args.tp, cp=args.cp)
    text = scale_markdown(system, model, rows, args, work.compute)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.plot:
        title = f"{Path(args.model).stem} on {system.name}, {_per_gpu(model, args)} per GPU"
        scaling.plot(rows, args.plot, title)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _per_gpu(model, args) -> str:
    if isinstance(model, dict):
        return "the description's compute" if "compute_ms" in model else f"{args.batch} samples"
    return f"{args.batch} x {model.context_length} tokens"


def scale_markdown(system, model, rows, args, compute=None) -> str:
    """The rows as markdown; `compute`: where a conf model's compute came from (measured.Compute)."""
    mesh = f", tensor parallel over {args.tp} GPUs (its comm ms in 'comm ms', all exposed)" if args.tp > 1 else ""
    cp = getattr(args, "cp", 1)
    if cp > 1:
        exposed = ", ".join(f"{r['cp_unhidden_ms']:.1f}" for r in rows[:1])
        mesh += (f", context parallel over {cp} GPUs (zigzag ring: {rows[0]['cp_ms']:.1f} ms of exchange in "
                 f"'comm ms', {exposed} ms of it not hidden by the attention, in the step)") if rows else ""
    lines = [f"{Path(args.model).stem} on {system.name} ({system.gpus_per_node} GPUs per node){mesh}, "
             f"{_per_gpu(model, args)} per {'data-parallel shard' if args.tp * cp > 1 else 'GPU'}, "
             + ("compute as described" if compute is None else
                                                     f"bf16 mixed precision\n\n{compute.line[0].upper()}"
                                                     f"{compute.line[1:]}"), "",
             "| strategy | GPUs | step ms | exposed comm ms | comm ms | step ms on torch's estimator "
             "| efficiency vs one node | best bucket MiB | torch's bucket rule MiB | compute-bound tokens/GPU |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def mb(v):
        return "-" if v is None else format(round(v, 1), "g")

    for r in rows:
        lines.append(f"| {r['strategy']} | {r['world_size']} | {r['step_ms']:.1f} | {r['exposed_ms']:.1f} | "
                     f"{r['comm_ms']:.1f} | {r['torch_step_ms']:.1f} | {100 * r['efficiency']:.0f}% | "
                     f"{mb(r['best_bucket_mb'])} | {mb(r['torch_rule_mb'])} | "
                     f"{'-' if r['compute_bound_tokens'] is None else format(r['compute_bound_tokens'], ',.0f')} |")
    lines += ["", "Sources: " + "; ".join(system.sources),
              "torch's estimator: torch/_inductor/comm_analysis.py (estimate_nccl_collective_runtime_impl) in the same "
              "replay; torch's bucket rule: its compute_min_saturation_bytes (90% of the link's bandwidth)"]
    return "\n".join(lines)


def cmd_record(args) -> int:
    """Every floor job of a GPU sweep (strategy=none, one rank) into the measured table."""
    from datetime import date

    from ddp_lab.analysis.records import load_runs
    from ddp_lab.jobdir import RESULTS

    if not Path(args.sweep).exists():
        raise PredictError(f"no such folder: {args.sweep}")
    rows = []
    for _, res, job in load_runs(args.sweep):
        when = date.fromtimestamp((job / RESULTS).stat().st_mtime).isoformat() if (job / RESULTS).exists() else ""
        row = measuring.row_from_job(res, when, str(job))
        if row is not None:
            rows.append(row)
    if not rows:
        raise PredictError(f"no finished floor job (strategy=none, one rank, on a GPU) under {args.sweep}")
    added, replaced = measuring.record(rows, args.table)
    for r in rows:
        print(f"{r['device']}: {r['model']} batch {r['batch']} {r['precision']} "
              f"{'compiled' if r['compile'] else 'eager'}: step {r['step_ms']:.1f} ms (forward and backward "
              f"{r[FWD_BWD.key]:.1f}, optimizer {r[OPTIMIZER.key]:.1f})")
    print(f"wrote {args.table}: {added} rows added, {replaced} replaced")
    return 0


def cmd_heldout(args) -> int:
    text = holding_out.markdown(holding_out.run(args.out))
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
        print(f"wrote {args.markdown}", file=sys.stderr)
    return 0


def cmd_published(args) -> int:
    text = publishing.report()
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
        print(f"wrote {args.markdown}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_lab.predict", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fit", help="fit collectives and compute from a collective sweep and one profiled run")
    f.add_argument("collective_sweep", help="a task=allreduce sweep folder")
    f.add_argument("profiled_run", help="a training job run with profile=true (or a folder holding one)")
    f.add_argument("-o", "--output", default="model.json", help="model file to write (default: model.json)")
    v = sub.add_parser("validate", help="predicted vs measured p50 step time for every job of a training sweep")
    v.add_argument("model", help="a model file written by fit")
    v.add_argument("sweep", help="a training sweep folder (or one job folder)")
    v.add_argument("--markdown", help="also write the table as markdown to this file")
    s = sub.add_parser("scale", help="predicted step time on a named GPU system at several world sizes")
    s.add_argument("--system", default="h100-nvlink", help=f"one of {', '.join(SYSTEMS)}")
    s.add_argument("--model", default="xl", help="a conf/model name (small, medium, large, xl, 2.7b, tiny) or a "
                   "model description FILE.json (parameters and compute; docs/notebook/predict.md)")
    s.add_argument("--world-size", default="8,64,512", help="comma-separated GPU counts")
    s.add_argument("--strategy", default="bucketed,zero1,zero2,fsdp", help=f"comma-separated, of "
                   f"{', '.join(scaling.scalable())}")
    s.add_argument("--batch", type=int, default=4, help="sequences per GPU (default 4, Table 1's batch)")
    s.add_argument("--context", type=int, help="context length (default: the model's)")
    s.add_argument("--compile", action="store_true", help="price compute from compiled measurements (train.compile)")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: each world size as dp x tp (a conf "
                   "model's plan; TP's collectives priced over tp ranks, added whole)")
    s.add_argument("--cp", type=int, default=1, help="context-parallel degree: each world size as dp x cp x tp, a "
                   "shard's sequences split over cp GPUs by tokens (zigzag ring: exchange priced, hidden under "
                   "attention where it can)")
    s.add_argument("--mfu", type=float, help="price compute at the GPU's peak x this fraction instead, the measured "
                   "table ignored (what-if; the system's assumption is 0.5)")
    s.add_argument("--compute-table", help="a measured compute table (default: the lab's, "
                   "ddp_lab/analysis/predict/measured/gpu_compute.json)")
    s.add_argument("--markdown", help="also write the tables to this file")
    s.add_argument("--plot", help="draw step time and efficiency against world size to this PNG")
    r = sub.add_parser("record", help="a GPU sweep's floor jobs (strategy=none, one rank) into the measured "
                       "compute table scale prices compute from")
    r.add_argument("sweep", help="a sweep or job folder run on a GPU")
    r.add_argument("--table", default=str(measuring.TABLE), help="the table to add to (default: the lab's)")
    p = sub.add_parser("published", help="predictions against published GPU measurements (NVIDIA's H100 all-reduce, "
                       "torch's DDP benchmark on V100s, torchtitan's Llama 3 8B FSDP), torch's estimator beside")
    p.add_argument("--markdown", help="also write the tables to this file")
    h = sub.add_parser("heldout", help="score the predictor per held-out group of benchmarks/predict_heldout.sh's OUT")
    h.add_argument("out", help="the folder benchmarks/predict_heldout.sh wrote")
    h.add_argument("--markdown", help="also write the tables to this file")
    args = parser.parse_args(argv)
    try:
        return {"fit": cmd_fit, "validate": cmd_validate, "scale": cmd_scale, "record": cmd_record,
                "published": cmd_published, "heldout": cmd_heldout}[args.command](args)
    except (PredictError, ResultsSchemaError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
