"""The planner against layouts measured on this machine (issue 66; docs/measured/plan.md).

    python benchmarks/plan_check.py calibrate          # ddp_lab/analysis/plan/this_machine.json (34 jobs, 15-40 s each)
    python benchmarks/plan_check.py sweep outputs/bench/plan --gpus 4 8      # every layout, launch.py each (25 min)
    python benchmarks/plan_check.py table outputs/bench/plan       # the tables, and OUT/measured.json
    python benchmarks/plan_check.py table docs/measured/plan_2026-11-28.json    # the docs' rows, scored again
    python benchmarks/plan_check.py table docs/measured/plan_2026-11-28.json --calibration OLD.json  # by another
    python benchmarks/plan_check.py sweep outputs/bench/plan_held_out --gpus 4 --held-out   # one choice apart
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen --unseen      # another context and batch
    python benchmarks/plan_check.py table outputs/bench/plan_unseen --unseen
    python benchmarks/plan_check.py sweep outputs/bench/plan_fsdp_pipeline --fsdp-pipeline    # FSDP2 under pp, 12 jobs
    python benchmarks/plan_check.py table outputs/bench/plan_fsdp_pipeline --fsdp-pipeline
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen_batch --unseen-batch   # 16 sequences of 128
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen_context --unseen-context   # 8 sequences of 256
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen_long --unseen-long   # 4 sequences of 512
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen_384 --unseen-384   # 4 sequences of 384
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen_192 --unseen-192   # 12 sequences of 192
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen_320 --unseen-320   # 6 sequences of 320
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen_160 --unseen-160   # 10 sequences of 160
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen_224 --unseen-224   # 8 sequences of 224
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen_96 --unseen-96   # 16 sequences of 96
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen_deep --unseen-deep   # 8 blocks of 192, 8 x 128
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen_wide --unseen-wide   # 4 blocks of 384, 8 x 64
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen_eight --unseen-eight   # 8 blocks of 256, 8 x 64
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen_six --unseen-six   # 6 blocks of 320, 8 x 64
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen_five --unseen-five   # 5 blocks of 288, 8 x 96
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen_seven --unseen-seven   # 7 blocks of 224, 8 x 128
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen_nine --unseen-nine   # 9 blocks of 160, 8 x 192
    python benchmarks/plan_check.py sweep outputs/bench/plan_unseen_three --unseen-three   # 3 blocks of 416, 8 x 160
    python benchmarks/plan_check.py alternate outputs/bench/alt_three --unseen-three --gpus 4 --split 2 1 2 1
    python benchmarks/plan_check.py alternate outputs/bench/alt_long --unseen-long --gpus 4 --schedule gpipe

`calibrate` measures what `--system this-machine` needs, before any layout runs and never from one: one core's FLOP/s
and the optimizer's bytes/s from the floor (`strategy=none`, 2 ranks, one per core), apart for attention's scores
and weighted sum from the floor at CONTEXTS (the least of ROUNDS jobs each, alternating; the rates fitted to them
all: docs/measured/plan_floor_curve.md), a micro-batch's
fixed cost from the floor again in 8 micro-batches (`train.grad_accum_steps=8`, the same FLOPs), the least a
context-parallel ring step takes with 2 ranks a core (dp 2 x cp 2 under the lab's `flat` strategy, which the planner
does not rank: its exposed ring time over its ring steps) and the least a ring collective costs (the same job in 8
micro-batches of one sequence, the least of ROUNDS: docs/measured/plan_context_collective.md),
gloo's all-reduce on loopback (16 MiB: bandwidth; 1 KiB: a ring step's latency) and across two emulated nodes joined
by the link, and the lab's own ring reduce-scatter and all-gather on loopback (16 MiB: what the sharded strategies
run on gloo).
`sweep` runs every layout the planner enumerates for the model and batch at each rank count, with torch_ddp, no
activation checkpointing and the 1F1B schedule (the other strategies, checkpointing and schedules multiply the jobs,
about 25 s each here, by 16), and the fewest and the most micro-batches the planner tries; each job on two emulated
nodes joined by the calibrated link. A job already measured under OUT is kept. `alternate` runs the strategies
the planner ranks on one split in turns, several rounds, to tell a strategy's cost from the hour's
(docs/measured/plan_strategy_ties.md). `table` prices each measured layout
with the planner and scores it (ddp_lab/analysis/plan/against_runs.py); it writes OUT/measured.json, the rows the
docs keep. `--unseen`: a job the planner was not tuned on, scored as it ran (context 128, a global batch of 8
sequences: the same tokens a step), at each rank count the planner's top UNSEEN_TOP and UNSEEN_SPREAD more spread
evenly down the rest of its ranking, every strategy, schedule and checkpointing it ranks. `--unseen-batch`: the same
choice at context 128 and 16 sequences a step (twice the tokens), a setting no change to the pricing was drawn from.
`--unseen-context`: the same choice at context 256 and 8 sequences (the tokens of `--unseen-batch`), after the
changes of 2026-11-30 that the unseen batch's rows showed. `--unseen-long`: context 512 and 4 sequences (the same
tokens), after attention's own rate and the ring's wait were calibrated (2026-11-30). `--unseen-384`: context 384 and 4
sequences, after the ring's wait was priced as a floor (2026-11-30). `--unseen-192`: context 192 and 12 sequences,
after the floor's contexts were fitted together (2026-11-30). `--unseen-320`: context 320 and 6 sequences, after the
bubble was priced as the fill and drain through the other stages and the step range recomputed (2026-11-30).
`--unseen-160`: context 160 and 10 sequences, after the lab's block under TP was counted with its norms whole.
`--unseen-224`: context 224 and 8 sequences, after FSDP2's accumulation and TP's wait on shared cores were priced.
`--unseen-96`: context 96 and 16 sequences, the same pricing again. `--unseen-deep`: another model shape (8 blocks of
width 192) at context 128 and 8 sequences, the same pricing again. `--unseen-wide`: the second (4 blocks of width 384)
at context 64 and 8 sequences, after a pipeline's ranks were priced sharing the cores. `--unseen-eight`: a third (8
blocks of tiny's width) at the same context and batch, the same pricing again. `--unseen-six`: a fourth (6 blocks of
width 320) at the same context and batch, after selective checkpointing's cost was calibrated. `--unseen-five`: a
fifth (5 blocks of width 288) at context 96, after the sharded strategies were priced on the lab's own rings.
`--unseen-seven`: a sixth (7 blocks of width 224) at context 128, after each end stage's memory got its own blocks.
`--unseen-nine`: a seventh (9 blocks of width 160) at context 192, after a context-parallel ring collective's least
cost was calibrated. `--unseen-three`: an eighth (3 blocks of width 416) at context 160, after full checkpointing's
peak was counted as the recompute or the log-softmax.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddp_lab.analysis.plan.against_runs import markdown, score  # noqa: E402
from ddp_lab.analysis.plan.cli import launch_line, load_shape  # noqa: E402
from ddp_lab.analysis.plan.host import (  # noqa: E402
    CALIBRATION,
    NODES,
    compute_rates,
    load_calibration,
    ring_collective_s,
    ring_wait_s,
    selective_costs,
    this_host,
    this_machine,
)
from ddp_lab.analysis.plan.price import Layout, ring_collectives, ring_steps  # noqa: E402
from ddp_lab.analysis.plan.search import layouts, microbatch_counts, plan  # noqa: E402
from ddp_lab.analysis.plan.shapes import with_context  # noqa: E402
from ddp_lab.analysis.predict.costs import PredictError  # noqa: E402

MODEL, SEQUENCES, GBPS, STEPS = "tiny", 16, 1.0, 8
SIZE_MB, LATENCY_MB = 16, 1 / 1024
LAB_RING_OPS = ("reduce_scatter", "all_gather")
UNSEEN = {"context": 128, "sequences": 8}
UNSEEN_BATCH = {"context": 128, "sequences": 16}
"""`--unseen-batch`: the unseen check's context at twice its global batch, a setting no pricing change has seen."""
UNSEEN_CONTEXT = {"context": 256, "sequences": 8}
"""`--unseen-context`: twice the unseen check's context, the unseen batch's tokens a step."""
UNSEEN_LONG = {"context": 512, "sequences": 4}
"""`--unseen-long`: twice `--unseen-context`'s context, the same tokens a step: a context no calibration or pricing
change had seen (the calibration then measured the floor at 64 and 256), after attention's rate and the ring's wait."""
UNSEEN_384 = {"context": 384, "sequences": 4}
"""`--unseen-384`: between `--unseen-context` and `--unseen-long`, a context no calibration or pricing change has seen,
after the ring's wait was priced as a floor under each ring step (drawn from `--unseen-long`'s rows)."""
UNSEEN_192 = {"context": 192, "sequences": 12}
"""`--unseen-192`: a context and a global batch no check has run (12 sequences: a batch 8 ranks cannot split), after
the floor's contexts were fitted together (docs/measured/plan_floor_curve.md)."""
UNSEEN_320 = {"context": 320, "sequences": 6}
"""`--unseen-320`: another context and global batch no check has run (6 sequences: dp 1, 2, 3 or 6), after the bubble
was priced as the fill and drain through the other stages and the step range recomputed from every row on record."""
UNSEEN_160 = {"context": 160, "sequences": 10}
"""`--unseen-160`: another context and global batch no check has run (10 sequences: dp 1, 2, 5 or 10), after the lab's
block under TP was counted with its norms whole (a memory term: the steps are priced as for `--unseen-320`)."""
UNSEEN_224 = {"context": 224, "sequences": 8}
"""`--unseen-224`: a context no check has run (8 sequences: dp up to 8), after FSDP2's accumulation was priced as the
lab issues it (docs/measured/plan_fsdp_accumulation.md), TP's all-reduces with their wait on shared cores and selective
checkpointing's recomputed all-reduce (docs/measured/plan_tp_wait.md), and the step range recomputed from 486 rows."""
UNSEEN_96 = {"context": 96, "sequences": 16}
"""`--unseen-96`: a context shorter than any check's since the first day's 64, at a global batch of 16 sequences, run
after `--unseen-224` with nothing changed between them: the second check in a row of the same pricing."""
UNSEEN_DEEP = {"context": 128, "sequences": 8,
               "model": {"num_layers": 8, "d_model": 192, "d_ff": 768, "num_heads": 4}}
"""`--unseen-deep`: another model shape, the first: tiny twice as deep and three quarters as wide (8 blocks of 192,
4 heads of 48; about tiny's FLOPs a token, in smaller matmuls, twice the TP all-reduces and pipeline stages up to 8),
at `--unseen`'s context and batch, with the pricing of `--unseen-224` and `--unseen-96` unchanged. The calibration
measured tiny's floor: whether its rates carry to narrower matmuls is part of what is checked."""
UNSEEN_WIDE = {"context": 64, "sequences": 8,
               "model": {"num_layers": 4, "d_model": 384, "d_ff": 1536, "num_heads": 6}}
"""`--unseen-wide`: the second model shape, the other way from `--unseen-deep`: tiny's 4 blocks half as wide again
(width 384, 6 heads of 64, d_ff 1536: 2.0x tiny's FLOPs a token), at context 64 and 8 sequences (about the tokens'
FLOPs of `--unseen-deep`'s step), run after a pipeline's ranks were priced sharing the cores (drawn from
`--unseen-deep`'s rows), nothing changed after. Wider matmuls than any calibration measured."""
UNSEEN_EIGHT = {"context": 64, "sequences": 8, "model": {"num_layers": 8}}
"""`--unseen-eight`: a third model shape, tiny twice as deep at its own width (8 blocks of 256: 1.6x tiny's FLOPs a
token, stages of 1 to 8 blocks), at `--unseen-wide`'s context and batch, with `--unseen-wide`'s pricing unchanged:
the second check in a row of it."""
UNSEEN_SIX = {"context": 64, "sequences": 8,
              "model": {"num_layers": 6, "d_model": 320, "d_ff": 1280, "num_heads": 5}}
"""`--unseen-six`: a fourth model shape, chosen before any of its rows ran: 6 blocks of width 320 (5 heads of 64, d_ff
1280: 1.9x tiny's FLOPs a token, the head counted; blocks that split unevenly over 4 stages), at `--unseen-wide`'s
context and batch, run after selective checkpointing's cost was calibrated on the floor (host.py's
`selective_costs`), nothing changed after."""
UNSEEN_FIVE = {"context": 96, "sequences": 8,
               "model": {"num_layers": 5, "d_model": 288, "d_ff": 1152, "num_heads": 6}}
"""`--unseen-five`: a fifth model shape, chosen before any of its rows ran: 5 blocks of width 288 (6 heads of 48,
d_ff 1152; blocks that split unevenly over 2 and 4 stages) at context 96 and 8 sequences, run after the sharded
strategies' collectives were priced on the lab's own rings (docs/measured/plan_lab_rings.md), nothing changed
after."""
UNSEEN_SEVEN = {"context": 128, "sequences": 8,
                "model": {"num_layers": 7, "d_model": 224, "d_ff": 896, "num_heads": 7}}
"""`--unseen-seven`: a sixth model shape, chosen before any of its rows ran: 7 blocks of width 224 (7 heads of 32,
d_ff 896; 4 and 3 blocks over 2 stages, 2, 2, 2 and 1 over 4) at context 128 and 8 sequences, run after each end
stage's memory was priced with its own blocks, nothing changed after."""
UNSEEN_NINE = {"context": 192, "sequences": 8,
               "model": {"num_layers": 9, "d_model": 160, "d_ff": 640, "num_heads": 4}}
"""`--unseen-nine`: a seventh model shape, chosen before any of its rows ran: 9 blocks of width 160 (4 heads of 40,
d_ff 640; 5 and 4 blocks over 2 stages, 3, 2, 2 and 2 over 4) at context 192 and 8 sequences, run after each
collective of a context-parallel ring was priced at least its calibrated cost on shared cores
(docs/measured/plan_context_collective.md), nothing changed after."""
UNSEEN_THREE = {"context": 160, "sequences": 8,
                "model": {"num_layers": 3, "d_model": 416, "d_ff": 1664, "num_heads": 8}}
"""`--unseen-three`: an eighth model shape, chosen before any of its rows ran: 3 blocks of width 416 (8 heads of
52, d_ff 1664; 2 and 1 blocks over 2 stages, no 4-stage split) at context 160 and 8 sequences, run after full
checkpointing's peak was counted as the larger of the recompute and the loss's log-softmax
(docs/measured/plan_full_peak.md), nothing changed after."""
UNSEEN_SETTINGS = {"unseen_batch": UNSEEN_BATCH, "unseen_context": UNSEEN_CONTEXT, "unseen_long": UNSEEN_LONG,
                   "unseen_384": UNSEEN_384, "unseen_192": UNSEEN_192, "unseen_320": UNSEEN_320,
                   "unseen_160": UNSEEN_160, "unseen_224": UNSEEN_224,
                   "unseen_96": UNSEEN_96, "unseen_deep": UNSEEN_DEEP, "unseen_wide": UNSEEN_WIDE,
                   "unseen_eight": UNSEEN_EIGHT, "unseen_six": UNSEEN_SIX,
                   "unseen_five": UNSEEN_FIVE, "unseen_seven": UNSEEN_SEVEN, "unseen_nine": UNSEEN_NINE,
                   "unseen_three": UNSEEN_THREE}
UNSEEN_TOP, UNSEEN_SPREAD = 6, 8
MICRO = 8  # the floor's accumulated micro-batches (one sequence each per rank): a micro-batch's fixed cost
CONTEXTS = (64, 128, 256, 512)  # the floor's contexts, for attention's own rate: 1 % of tiny's FLOPs at 64, 7 % at
# 512; fitted to all of them, since one pair of contexts lets one floor's noise decide the rate (it did, threefold)
ROUNDS = 3  # each floor's jobs, the least taken: a slow spell of the host only adds, and moved a floor by a quarter
RING_RANKS, RING_CP, RING_STRATEGY, RING_STEPS = 4, 2, "flat", 24  # a ring's wait: 2 ranks a core, a strategy
# the planner does not rank, more steps than a layout's job for a steadier mean


def launch(out: Path, *overrides: str) -> dict:
    """One launch.py job into `out`, unless it ran there already; its results (a failed job's status kept)."""
    if not (out / "results.json").exists():
        subprocess.run(["timeout", "600", sys.executable, str(ROOT / "launch.py"), *overrides,
                        f"hydra.run.dir={out}"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=False)
    return results_of(out)


def results_of(out: Path) -> dict:
    """A job folder's results.json; a job that wrote none, as a status saying so."""
    try:
        return json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return {"status": "no results.json"}


def job_name(lay) -> str:
    """A layout's job folder: its description, as a name."""
    return lay.describe().replace(" ", "_").replace(":", "-")


def p50(res: dict, key: str) -> float:
    return res["summary"][key]["p50"]


def calibration_jobs(out: Path) -> dict:
    """Run (or reuse) calibrate's jobs under `out`: {job name: its results}; exits naming the first that failed."""
    floor_job = (f"model={MODEL}", f"train.batch_size={SEQUENCES}", f"train.steps={STEPS}", "strategy=none",
                 "world_size=2")
    done = {}  # job name, its folder under `out`: its results

    def run(name: str, *overrides: str) -> None:
        done[name] = launch(out / name, *overrides)

    for r in range(1, ROUNDS + 1):  # alternating, so that a slow spell of the host falls on every context
        for context in CONTEXTS:
            run(f"floor_{context}_{r}", *floor_job, f"model.context_length={context}")
        run(f"accumulated_{r}", *floor_job, f"train.grad_accum_steps={MICRO}")
        run(f"selective_{r}", *floor_job, "train.activation_checkpointing=selective")
        run(f"selective_accumulated_{r}", *floor_job, "train.activation_checkpointing=selective",
            f"train.grad_accum_steps={MICRO}")
    ring_job = (f"model={MODEL}", f"train.batch_size={SEQUENCES}", f"train.steps={RING_STEPS}",
                f"strategy={RING_STRATEGY}", f"world_size={RING_RANKS}", f"parallel.cp={RING_CP}",
                "parallel.cp_impl=zigzag")
    run("ring", *ring_job)
    for r in range(1, ROUNDS + 1):  # one sequence a micro-batch, the least of ROUNDS
        run(f"ring_accumulated_{r}", *ring_job, f"train.grad_accum_steps={MICRO}")
    run("loopback", "task=allreduce", "world_size=2", f"task.size_mb={SIZE_MB}")
    run("latency", "task=allreduce", "world_size=2", f"task.size_mb={LATENCY_MB}")
    for r in range(1, ROUNDS + 1):  # the lab's rings (strategies/rings.py): what zero2, FSDP2 and zero1_torch run
        for op in LAB_RING_OPS:      # on gloo; the fastest of ROUNDS (one job ran from 0.85 to 1.07 GB/s)
            run(f"ring_{op}_{r}", "task=allreduce", f"task.op={op}", "world_size=2", f"task.size_mb={SIZE_MB}")
    run("link", "task=allreduce", "world_size=2", f"task.size_mb={SIZE_MB}", "network=emulated",
        f"network.nodes={NODES}", f"network.gbps={GBPS:g}")
    for name, res in done.items():
        if res.get("status") != "ok":
            sys.exit(f"calibrate: the {name} job did not end ok ({res.get('status')}); see {out / name}")
    return done


def calibrate(out: Path) -> None:
    shape, done = load_shape(MODEL), calibration_jobs(out)
    floors = {c: [done[f"floor_{c}_{r}"] for r in range(1, ROUNDS + 1)] for c in CONTEXTS}
    ring, loop, tick, link = (done[k] for k in ("ring", "loopback", "latency", "link"))
    least = {c: min(p50(res, "fwd_bwd_ms") for res in floors[c]) for c in CONTEXTS}
    rounds = {name: [p50(done[f"{name}_{r}"], "fwd_bwd_ms") for r in range(1, ROUNDS + 1)]
              for name in ("accumulated", "selective", "selective_accumulated")}
    floor = {"fwd_bwd_ms": least[shape.context],
             "optimizer_ms": min(p50(res, "optimizer_ms") for res in floors[shape.context])}
    accumulated = min(rounds["accumulated"])
    microbatch_s = (accumulated - floor["fwd_bwd_ms"]) / (MICRO - 1) / 1e3  # the same FLOPs in MICRO micro-batches
    most = max(ring["summary"]["mesh"]["context"]["per_rank"], key=lambda r: r["exposed_ms"])  # most-waiting cp rank
    ring_layout, one = Layout(dp=RING_RANKS // RING_CP, cp=RING_CP), p50(ring, "fwd_bwd_ms")
    steps = ring_steps(ring_layout) * shape.layers  # one micro-batch a step
    many = [p50(done[f"ring_accumulated_{r}"], "fwd_bwd_ms") for r in range(1, ROUNDS + 1)]
    collectives = ring_collectives(ring_layout) * shape.layers * MICRO
    try:
        core_flops, attention_flops = compute_rates(shape, SEQUENCES // 2, least)
        # selective's cost over the floor, in one micro-batch and in MICRO: the same tokens, MICRO times the blocks run
        block_s, selective_Bps = selective_costs(shape, SEQUENCES // 2, attention_flops, MICRO,
                                                 min(rounds["selective"]) - floor["fwd_bwd_ms"],
                                                 min(rounds["selective_accumulated"]) - accumulated)
        collective_s = ring_collective_s(min(many), one, most["exposed_ms"], MICRO, microbatch_s, collectives,
                                         RING_RANKS / os.cpu_count())
    except PredictError as exc:
        sys.exit(f"calibrate: {exc}; measure again on an idle machine")
    waited = {"ranks": RING_RANKS, "cp": RING_CP, "strategy": RING_STRATEGY, "exposed_ms": most["exposed_ms"],
              "exchange_alone_ms": most["exchange_alone_ms"], "ring_steps": steps, "fwd_bwd_ms": one}
    accumulated_ring = {"micro_batches": MICRO, "fwd_bwd_ms": many, "collectives": collectives}
    cal = {
        "machine": this_host(), "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/plan_check.py calibrate",
        "cores": os.cpu_count(), "nodes": NODES, "gbps": GBPS,
        "core_flops": core_flops, "attention_flops": attention_flops,
        "optimizer_Bps": 28 * shape.params / (floor["optimizer_ms"] / 1e3),
        "loopback_busbw_Bps": loop["summary"]["busbw_GBps"] * 1e9,
        "ring_busbw_Bps": {op: max(done[f"ring_{op}_{r}"]["summary"]["busbw_GBps"] for r in range(1, ROUNDS + 1)) * 1e9
                           for op in LAB_RING_OPS},
        "link_busbw_Bps": link["summary"]["busbw_GBps"] * 1e9,
        "latency_s": p50(tick, "latency_ms") / 1e3 / 2,  # a 2-rank all-reduce: 2 ring steps
        "ring_wait_s": ring_wait_s(most["exposed_ms"], steps), "ring_collective_s": collective_s,
        "microbatch_s": microbatch_s,
        "selective_block_s": block_s, "selective_Bps": selective_Bps,
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "from": {"model": MODEL, "sequences": SEQUENCES, "floor_rounds": ROUNDS,
                 "floor_fwd_bwd_ms": {c: [p50(res, "fwd_bwd_ms") for res in floors[c]] for c in CONTEXTS},
                 "floor_optimizer_ms": floor["optimizer_ms"], "all_reduce_MiB": SIZE_MB,
                 "accumulated_micro_batches": MICRO, "accumulated_fwd_bwd_ms": rounds["accumulated"],
                 "selective_fwd_bwd_ms": rounds["selective"],
                 "selective_accumulated_fwd_bwd_ms": rounds["selective_accumulated"],
                 "latency_all_reduce_ms": p50(tick, "latency_ms"), "ring_job": waited,
                 "ring_accumulated_job": accumulated_ring},
    }
    CALIBRATION.write_text(json.dumps(cal, indent=1) + "\n")
    print(json.dumps(cal, indent=1))


def checked_layouts(gpus: int, held_out: bool = False):
    """The planner's layouts for the check (module docstring): torch_ddp, no checkpointing, 1F1B, the fewest and
    the most micro-batches it tries. `held_out`: the rest at the fewest micro-batches, each differing from a checked
    layout in one choice: another strategy (zero1_torch, zero2, fsdp_torch), another schedule (GPipe, interleaved,
    zero bubble), or checkpointing (data parallel only, where the lab runs it)."""
    shape, system = load_shape(MODEL), this_machine(gpus)
    for lay in layouts(shape, system, gpus, SEQUENCES):
        counts = microbatch_counts(SEQUENCES // lay.dp, lay.pp)
        plain = lay.strategy == "torch_ddp" and lay.schedule == "1f1b" and lay.checkpointing == "none"
        if not held_out:
            if plain and lay.microbatches in (counts[0], counts[-1]):
                yield lay
            continue
        one_apart = ((lay.strategy != "torch_ddp") + (lay.schedule != "1f1b") + (lay.checkpointing != "none")) == 1
        data_parallel = lay.tp == lay.pp == lay.cp == 1
        if lay.microbatches == counts[0] and one_apart and (lay.checkpointing == "none" or data_parallel):
            yield lay


CHECKS = ("checked", "held_out", "unseen", "fsdp_pipeline", *UNSEEN_SETTINGS)
"""The checks a sweep or table runs (module docstring): the checked layouts, `--held-out`, `--unseen`,
`--fsdp-pipeline` (at `--unseen`'s context and batch), and `--unseen`'s choice of layouts at each of
UNSEEN_SETTINGS (`--unseen-batch`, `--unseen-context`, `--unseen-long`, `--unseen-384`, `--unseen-192`,
`--unseen-320`, `--unseen-160`, `--unseen-224`, `--unseen-96`, `--unseen-deep`, `--unseen-wide`,
`--unseen-eight`)."""


def model_keys(check: str) -> dict:
    """The model keys a check changes (`--set` to the planner, `model.KEY=VALUE` to launch.py): none but
    the model-shape checks' (`--unseen-deep`, `--unseen-wide`, `--unseen-eight`)."""
    return UNSEEN_SETTINGS.get(check, {}).get("model", {})


def setting(check: str = "checked") -> tuple:
    """(shape, sequences a step) of a check: tiny as configured, or an unseen check's context, batch and shape."""
    if check in UNSEEN_SETTINGS:
        chosen = UNSEEN_SETTINGS[check]
        return with_context(load_shape(MODEL, model_keys(check)), chosen["context"]), chosen["sequences"]
    if check in ("unseen", "fsdp_pipeline"):
        return with_context(load_shape(MODEL), UNSEEN["context"]), UNSEEN["sequences"]
    return load_shape(MODEL), SEQUENCES


def unseen_layouts(gpus: int, check: str = "unseen") -> list:
    """An unseen check's layouts at `gpus` ranks (module docstring), the planner's order."""
    shape, sequences = setting(check)
    ranked = plan(shape, this_machine(gpus), gpus, sequences, lab=True).ranked
    rest = ranked[UNSEEN_TOP:]
    step = max(1, len(rest) // UNSEEN_SPREAD)
    return [p.layout for p in ranked[:UNSEEN_TOP] + rest[step - 1::step][:UNSEEN_SPREAD]]


def fsdp_pipeline_layouts(gpus: int) -> list:
    """`--fsdp-pipeline`'s layouts at `gpus` ranks: FSDP2 under a pipeline as the lab runs it (gathered once a step,
    reduced once after the schedule), beside zero2 on the same split, under each schedule both run: the check of
    `price.py`'s `fsdp_copies_ms`, at `--unseen`'s context and batch (the term was drawn from context 64)."""
    return [Layout(dp=gpus // 2, pp=2, strategy=strategy, schedule=schedule, microbatches=2)
            for schedule in ("gpipe", "1f1b", "zero_bubble") for strategy in ("zero2", "fsdp_torch")]


def jobs(gpus: int, check: str = "checked") -> tuple:
    """(layouts, sequences, context) of a sweep at `gpus` ranks."""
    if check == "fsdp_pipeline":
        return fsdp_pipeline_layouts(gpus), UNSEEN["sequences"], UNSEEN["context"]
    if check == "unseen" or check in UNSEEN_SETTINGS:
        shape, sequences = setting(check)
        return unseen_layouts(gpus, check), sequences, shape.context
    return list(checked_layouts(gpus, check == "held_out")), SEQUENCES, None


def sweep(out: Path, gpus_list: list[int], check: str = "checked") -> None:
    for gpus in gpus_list:
        system = this_machine(gpus)
        todo, sequences, context = jobs(gpus, check)
        for i, lay in enumerate(todo, 1):
            line = launch_line(MODEL, lay, sequences, system, context, model_keys(check))
            overrides = shlex.split(line)[2:] + [f"train.steps={STEPS}"]
            res = launch(out / str(gpus) / job_name(lay), *overrides)
            said = f"{p50(res, 'step_time_ms'):.0f} ms" if res.get("status") == "ok" else res.get("status")
            print(f"{gpus} ranks {i}/{len(todo)} {lay.describe()}: {said}", flush=True)


def alternate(out: Path, gpus: int, split: tuple, schedule: str, rounds: int, check: str = "checked") -> None:
    """Each strategy the planner ranks on one split (dp, tp, pp, cp) at `gpus` ranks under `schedule`, the fewest
    micro-batches, no checkpointing, run in turns for `rounds` rounds (each round's order rotated, so a slow spell of
    the host falls on each alike): whether a gap between strategies the planner prices as a tie is the strategy or
    the hour. Each job's p50 step as it ends, then each strategy's rounds, least and median beside its price."""
    shape, sequences = setting(check)
    system = this_machine(gpus)
    ranked = plan(shape, system, gpus, sequences, lab=True).ranked
    on_split = [p for p in ranked if split_of(p.layout) == split and (p.layout.schedule == schedule or p.layout.pp == 1)
                and p.layout.checkpointing == "none"]
    fewest = min((p.layout.microbatches for p in on_split), default=None)
    chosen = [p for p in on_split if p.layout.microbatches == fewest]
    if not chosen:
        sys.exit(f"alternate: the planner ranks no {schedule} layout without checkpointing on split {split} at "
                 f"{gpus} ranks")
    steps = {p.layout: [] for p in chosen}  # by layout: interleaved 1F1B may rank a strategy at several v
    for r in range(rounds):
        for p in chosen[r % len(chosen):] + chosen[:r % len(chosen)]:
            line = launch_line(MODEL, p.layout, sequences, system, shape.context, model_keys(check))
            res = launch(out / str(gpus) / f"round_{r + 1}" / job_name(p.layout),
                         *shlex.split(line)[2:], f"train.steps={STEPS}")
            if res.get("status") != "ok":
                sys.exit(f"alternate: {p.layout.describe()} in round {r + 1} did not end ok ({res.get('status')})")
            steps[p.layout].append(p50(res, "step_time_ms"))
            print(f"round {r + 1} {p.layout.describe()}: {steps[p.layout][-1]:.0f} ms", flush=True)
    print("\n| strategy | priced ms | each round's p50 step, ms | least | median |\n|---|---:|---|---:|---:|")
    for p in chosen:
        got, v = steps[p.layout], p.layout.stages_per_rank
        name = p.layout.strategy + (f" v{v}" if v > 1 else "")
        print(f"| {name} | {p.step_ms:.0f} | {', '.join(f'{s:.0f}' for s in got)} | {min(got):.0f} "
              f"| {statistics.median(got):.0f} |")


def split_of(lay) -> tuple:
    """A layout's (dp, tp, pp, cp), as `--split` names it."""
    return lay.dp, lay.tp, lay.pp, lay.cp


def measured_rows(out: Path, check: str = "checked") -> list[dict]:
    """Every job under OUT with its layout and p50 step; failed ones with their status. A job is known by its name
    among every layout the planner enumerates at the check's setting, not among those it would choose now: a check
    scored again after a pricing change keeps every row it ran."""
    rows = []
    shape, sequences = setting(check)
    for gpus_dir in sorted(p for p in out.iterdir() if p.is_dir() and p.name.isdigit()):
        gpus = int(gpus_dir.name)
        by_name = {job_name(lay): lay for lay in layouts(shape, this_machine(gpus), gpus, sequences)}
        for job in sorted(gpus_dir.iterdir()):
            lay = by_name.get(job.name)
            if lay is None:
                continue
            res = results_of(job)
            row = {**lay.__dict__, "gpus": gpus, "status": res.get("status")}
            if res.get("status") == "ok":
                row["measured_ms"] = p50(res, "step_time_ms")
                row["measured_bytes"] = census_peak(res)
            rows.append(row)
    return rows


def census_peak(res: dict) -> int | None:
    """The census's most a rank held: its model state (as counted before the optimizer's step) and its activations'
    peak, the rank with the most."""
    ranks = (res["summary"].get("memory") or {}).get("per_rank") or []
    totals = [r["state_total"] + (r.get("activations") or 0) for r in ranks if r.get("state_total") is not None]
    return max(totals) if totals else None


def table(out: Path, markdown_file: Path | None, check: str = "checked", calibration: Path | None = None) -> None:
    if out.is_dir():
        rows = measured_rows(out, check)
        (out / "measured.json").write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")  # a row a line
    else:
        rows = json.loads(out.read_text())
    failed = [r for r in rows if r["status"] != "ok"]
    shape, sequences = setting(check)
    system = this_machine if calibration is None else partial(this_machine, calibration=load_calibration(calibration))
    scored = score(shape, system, sequences, [r for r in rows if r["status"] == "ok"])
    lines = markdown(scored)
    if failed:
        lines += ["", "Not measured (the job did not end ok): " + "; ".join(
            f"{r['gpus']} ranks {r['dp']}x{r['tp']}x{r['pp']}x{r['cp']} m{r['microbatches']}: {r['status']}"
            for r in failed)]
    text = "\n".join(lines) + "\n"
    print(text)
    if markdown_file:
        markdown_file.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("calibrate", "sweep", "table", "alternate"))
    ap.add_argument("out", nargs="?", type=Path, default=ROOT / "outputs" / "bench" / "plan",
                    help="the jobs' folder (table: or a measured.json)")
    ap.add_argument("--gpus", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--calibration", type=Path, default=None,
                    help="table: price with this calibration instead of the shipped this_machine.json (an older one: "
                         "git show COMMIT:ddp_lab/analysis/plan/this_machine.json > FILE)")
    ap.add_argument("--split", type=int, nargs=4, default=(2, 1, 2, 1), metavar=("DP", "TP", "PP", "CP"),
                    help="alternate: the split whose strategies run in turns")
    ap.add_argument("--schedule", default="1f1b", help="alternate: the pipeline schedule")
    ap.add_argument("--rounds", type=int, default=4, help="alternate: rounds of every strategy")
    ap.add_argument("--held-out", action="store_true", help="the layouts one choice apart from the checked ones")
    ap.add_argument("--unseen", action="store_true", help="another context and batch, scored as it ran")
    ap.add_argument("--fsdp-pipeline", action="store_true",
                    help="fsdp_torch and zero2 at dp x pp 2 under each schedule, at --unseen's context and batch")
    for name, chosen in UNSEEN_SETTINGS.items():  # one flag each: --unseen-batch ... --unseen-160
        shape = "".join(f", model.{k}={v}" for k, v in chosen.get("model", {}).items())
        ap.add_argument("--" + name.replace("_", "-"), action="store_true",
                        help=f"--unseen's choice of layouts at context {chosen['context']} and {chosen['sequences']} "
                             f"sequences{shape}")
    args = ap.parse_args()
    # one check: the last of CHECKS given
    check = next((name for name in reversed(CHECKS) if getattr(args, name, False)), "checked")
    if args.what == "calibrate":
        calibrate(args.out / "calibrate")
    elif args.what == "alternate":
        if args.rounds < 1:
            ap.error(f"--rounds must be at least 1, got {args.rounds}")
        alternate(args.out, args.gpus[0], tuple(args.split), args.schedule, args.rounds, check)
    elif args.what == "sweep":
        sweep(args.out, args.gpus, check)
    else:
        table(args.out, args.markdown, check, args.calibration)


if __name__ == "__main__":
    main()
