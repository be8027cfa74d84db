"""A pipeline job's bubble, read from its summary (summary.mesh.pipeline, ddp_lab/pipeline_parallel/): measured,
the schedule's own, and the schedule replayed at the stages' measured compute, so the gap between the formula and
the measurement splits into what the stages' imbalance costs (the embedding on the first stage, the norm and the
output head on the last) and the rest (the sends and receives, the ranks' noise); the activations and bytes it
sent against what the schedule says; and the picture of the schedule as it ran, stages as rows.

The formula assumes equal stages and free communication; the replay keeps free communication and takes each
stage's mean forward and backward (and zero bubble's I and W) as measured. Measured = 1 - compute / span per
stage rank (its first action of the step to its last send), averaged over the stages and the measured steps.
"""

from __future__ import annotations

from pathlib import Path

from ddp_lab.spec.parallel import layout_of
from ddp_lab.spec.pipeline import microbatches_of, schedule_actions, simulate, stage_index
from ddp_lab.units import MiB

KIND_COLORS = {"F": "#4C72B0", "B": "#C44E52", "I": "#DD8452", "W": "#55A868"}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward, input's gradient", "W": "backward, weights'"}


def pipeline_of(res: dict) -> dict | None:
    """summary.mesh.pipeline of a job's results, or None (no pipeline, or a job that wrote no summary)."""
    summary = res.get("summary") if isinstance(res, dict) else None
    mesh = (summary or {}).get("mesh") or {}
    return mesh.get("pipeline") or None


def stage_costs(pipeline: dict) -> list[dict[str, float]] | None:
    """Each stage's mean ms per action kind ({"F": ..., "B": ...}, by stage index), from every stage rank's
    `action_ms`; None where a stage has none (no step measured)."""
    per_stage, chunks = pipeline["per_stage"], pipeline["stages_per_rank"]
    pp = len(per_stage)
    costs: list[dict[str, float]] = [{} for _ in range(pp * chunks)]
    for entry in per_stage:
        for key, ms in (entry.get("action_ms") or {}).items():
            costs[stage_index(entry["pp_rank"], int(key[1:]), pp)][key[0]] = ms
    return costs if all(costs) else None


def replayed_bubble_pct(pipeline: dict) -> float | None:
    """The schedule's bubble at the stages' measured compute, communication free (spec/pipeline.py's simulate)."""
    costs = stage_costs(pipeline)
    if costs is None:
        return None
    kinds = {a.kind for r in range(len(pipeline["per_stage"])) for a in _actions(pipeline, r)}
    if any(kind not in stage for stage in costs for kind in kinds):
        return None  # an action kind never clocked (a schedule the runner ran otherwise)
    sim = simulate(pipeline["schedule"], len(pipeline["per_stage"]), pipeline["microbatches"],
                   pipeline["stages_per_rank"], stage_costs=costs)
    return 100 * sim.bubble()


def schedule_bubble_pct(pipeline: dict) -> float:
    """The published formula's bubble; zero bubble's own, simulated on paper (F 1, B 2, W half of B)."""
    formula = pipeline.get("bubble_formula_pct")
    return formula if formula is not None else pipeline["bubble_simulated_pct"]


def _actions(pipeline: dict, rank: int):
    return schedule_actions(pipeline["schedule"], len(pipeline["per_stage"]), pipeline["microbatches"], rank,
                            pipeline["stages_per_rank"])


def schedule_sends(pipeline: dict, rank: int) -> int:
    """Tensors stage rank `rank` sends in a step by its schedule: an activation after each F but the last stage's,
    an input gradient after each B or I but the first stage's."""
    pp, stages = len(pipeline["per_stage"]), len(pipeline["per_stage"]) * pipeline["stages_per_rank"]
    count = 0
    for act in _actions(pipeline, rank):
        s = stage_index(rank, act.chunk, pp)
        count += (act.kind == "F" and s < stages - 1) or (act.kind in ("B", "I") and s > 0)
    return count


def activation_bytes(cfg: dict) -> int | None:
    """One micro-batch's activation crossing a stage boundary: rows x this rank's tokens of the context x d_model in
    fp32 (the lab sends what a block returns; under autocast blocks still return their residual stream in fp32)."""
    model, train, parallel = cfg.get("model") or {}, cfg.get("train") or {}, cfg.get("parallel") or {}
    if not all(k in model for k in ("context_length", "d_model")) or not train.get("batch_size"):
        return None
    layout = layout_of(cfg)  # a data-parallel replica's rows, each rank its 1/cp of their tokens
    rows = train["batch_size"] // max(1, layout.dp) // microbatches_of(parallel)
    return rows * (model["context_length"] // layout.cp) * model["d_model"] * 4


def pipeline_record(res: dict) -> dict:
    """The flat record's pipeline figures (analysis/records.py); Nones for a job without a pipeline."""
    p = pipeline_of(res)
    if p is None:
        return {"pipeline": None, "bubble_pct": None, "bubble_schedule_pct": None, "bubble_stages_pct": None,
                "pp_idle_mean_ms": None, "pp_wait_mean_ms": None, "p2p_mib_per_step": None}
    stages = p["per_stage"]
    waits = [s["wait_ms"] for s in stages if s.get("wait_ms") is not None]
    sent = [s["p2p_bytes"] for s in stages if s.get("p2p_bytes") is not None]
    label = f"{p['schedule']} m={p['microbatches']}" + (f" v={p['stages_per_rank']}" if p["stages_per_rank"] > 1
                                                        else "") + f" {p['impl']}"
    idle = [s["span_ms"] - s["busy_ms"] for s in stages if s.get("span_ms") is not None]
    return {"pipeline": label, "bubble_pct": p.get("bubble_measured_pct"),
            "bubble_schedule_pct": schedule_bubble_pct(p), "bubble_stages_pct": replayed_bubble_pct(p),
            "pp_idle_mean_ms": sum(idle) / len(idle) if idle else None,
            "pp_wait_mean_ms": sum(waits) / len(waits) if waits else None,
            "p2p_mib_per_step": max(sent) / MiB if sent else None}


def verdict(res: dict) -> str | None:
    """What the job's bubble, activations and sends say beside the schedule's, in a paragraph; None without a
    pipeline or a measured step."""
    p = pipeline_of(res)
    if p is None or p.get("bubble_measured_pct") is None:
        return None
    pp, m, stages = len(p["per_stage"]), p["microbatches"], p["per_stage"]
    measured, schedule, replayed = p["bubble_measured_pct"], schedule_bubble_pct(p), replayed_bubble_pct(p)
    whose = "the formula's" if p.get("bubble_formula_pct") is not None else "its own on paper"
    parts = [f"{p['schedule']} ({p['impl']}), {pp} stage ranks, {m} micro-batches: measured bubble "
             f"{measured:.1f}%, {whose} {schedule:.1f}% ({measured - schedule:+.1f} points)."]
    costs = stage_costs(p)
    if replayed is not None and costs is not None:
        compute = [sum(c.values()) for c in costs]
        each = "; ".join(f"stage {s}: " + ", ".join(f"{k} {v:.1f}" for k, v in c.items()) for s, c in
                         enumerate(costs))
        parts.append(f"Replayed at the stages' measured compute (ms per micro-batch: {each}; the heaviest stage "
                     f"{max(compute) / min(compute):.2f}x the lightest) the schedule idles {replayed:.1f}%: unequal "
                     f"stages account for {replayed - schedule:+.1f} points, the sends, receives and the ranks' "
                     f"noise for {measured - replayed:+.1f}.")
    one = activation_bytes(res.get("config") or {})
    sent = [s.get("p2p_bytes") for s in stages]
    if one and all(b is not None for b in sent):
        want = [schedule_sends(p, s["pp_rank"]) for s in stages]
        parts.append("Sent per step: " + ", ".join(f"stage rank {s['pp_rank']} {b / MiB:.2f} MiB = "
                                                   f"{b / one:.2f} x one activation ({want[i]} by the schedule)"
                                                   for i, (s, b) in enumerate(zip(stages, sent))) + ".")
    peaks = [(s.get("activation_peak_bytes"), s.get("activation_microbatch_bytes")) for s in stages]
    if all(a and b for a, b in peaks):
        parts.append("Activations alive at most: " + ", ".join(
            f"stage rank {s['pp_rank']} {a / MiB:.1f} MiB = {a / b:.1f} micro-batches' "
            f"(the schedule's {p['in_flight_peak'][s['pp_rank']]})" for s, (a, b) in zip(stages, peaks)) + ".")
    return " ".join(parts)


def plot_schedules(jobs: dict[str, dict], path: Path) -> Path:
    """The last step of each pipeline job as it ran: one panel per job, a row per stage rank, each action a bar
    (forward, backward, zero bubble's halves) labelled with its micro-batch (and chunk, interleaved); the gaps
    are the bubble."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(jobs), 1, figsize=(12, 0.6 + 0.55 * sum(len(p["per_stage"]) + 1
                                                                          for p in jobs.values())), squeeze=False)
    for ax, (label, p) in zip(axes[:, 0], jobs.items()):
        pp = len(p["per_stage"])
        for entry in p["per_stage"]:
            row = pp - 1 - entry["pp_rank"]
            for kind, microbatch, chunk, _, start, end in entry.get("timeline") or []:
                ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (row - 0.4, 0.8), facecolor=KIND_COLORS[kind],
                               edgecolor="white", linewidth=0.6)
                name = f"{microbatch}" + (f".{chunk}" if p["stages_per_rank"] > 1 else "")
                ax.text((start + end) / 2 * 1e3, row, name, ha="center", va="center", fontsize=7, color="white",
                        clip_on=True)
        ax.set_yticks(range(pp), [f"stage rank {pp - 1 - r}" for r in range(pp)])
        measured = p.get("bubble_measured_pct")
        ax.set_title(f"{label}: bubble measured {measured:.1f}%, schedule's {schedule_bubble_pct(p):.1f}%"
                     if measured is not None else label, fontsize=9, loc="left")
        ax.set_xlabel("ms from the step's start (last step)")
    kinds = sorted({k for p in jobs.values() for e in p["per_stage"] for k, *_ in e.get("timeline") or []},
                   key=list(KIND_COLORS).index)
    fig.legend(handles=[Patch(color=KIND_COLORS[k], label=KIND_NAMES[k]) for k in kinds], loc="upper right",
               fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
