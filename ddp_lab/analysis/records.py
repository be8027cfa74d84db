"""A sweep's jobs found on disk and flattened into one record each: what every table shows (the
terminal's, report.md's: analysis/columns.py), report.csv holds, and the plots, the cost model and the
predictor read. One key per figure, whatever reads it: a per-step figure's statistics are named by its
row in spec/figures.py (`step_time_ms`'s p50 is `step_p50_ms`).

A failed or missing job is a record too (status and error), never a gap.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from omegaconf import OmegaConf

from ddp_lab.analysis.accuracy import accuracy
from ddp_lab.analysis.pipeline import pipeline_record
from ddp_lab.arithmetic.zero_bytes import model_state_bytes
from ddp_lab.jobdir import CONFIG, RESULTS, read_results
from ddp_lab.spec.figures import (
    ALGBW,
    BUSBW,
    CP_BYTES_BACKWARD,
    CP_BYTES_FORWARD,
    EP_BYTES,
    EXPOSED,
    EXPOSED_OPTIMIZER,
    FWD_BWD,
    LATENCY,
    OPTIMIZER,
    STEP_TIME,
    SYNC,
    TP_COMM,
    training_figures,
)
from ddp_lab.spec.labels import collective_label, row_label
from ddp_lab.units import MiB


def _get(d: dict | None, *path, default=None):
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d


def task_of(results: dict) -> str:
    """'train' or 'allreduce'; a job that died before saving its config counts as training."""
    return _get(results, "config", "task", "name", default="train") or "train"


# --- finding jobs --------------------------------------------------------------------------------

def _is_job(path: Path) -> bool:
    """results.json, or the config launch.py saves beside Hydra's .hydra/ (a job that never ended)."""
    return (path / RESULTS).exists() or ((path / CONFIG).exists() and (path / ".hydra").is_dir())


def _order(path: Path, root: Path):
    """Numeric job folders (Hydra's 0, 1, ..., 10) in numeric order, whatever their depth."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.relative_to(root).parts]


def find_jobs(root) -> list[Path]:
    """DIR itself if it is a job folder, else every job folder below it (sweeps of sweeps too)."""
    root = Path(root)
    if _is_job(root):
        return [root]
    jobs = {p.parent for name in (RESULTS, CONFIG) for p in root.rglob(name) if _is_job(p.parent)}
    return sorted(jobs, key=lambda p: _order(p, root))


def load_job(job: Path) -> dict:
    """results.json, or for a job killed before anyone wrote it, a 'missing' record with its config."""
    results = read_results(job)
    if results is not None:
        return results
    config = OmegaConf.to_container(OmegaConf.load(job / CONFIG), resolve=True) if (job / CONFIG).exists() else {}
    return {"status": "missing", "error": "no results.json: the job was killed before it ended",
            "config": config, "env": {}, "summary": {}, "steps": []}


def load_runs(root) -> list[tuple[str, dict, Path]]:
    """(name, results, folder) per job; the name is the folder relative to DIR ('.' for DIR)."""
    root = Path(root)
    runs = []
    for job in find_jobs(root):
        name = str(job.relative_to(root)) if job != root else job.name
        runs.append((name, load_job(job), job))
    return runs


# --- one flat record per job (report.csv, and what the plots read) -------------------------------

def _mean(res: dict, key: str):
    return _get(res, "summary", key, "mean")


def train_record(res: dict) -> dict:
    """Raw figures of a training job, and its mean step split into phases (means add up, medians
    do not). The phases (rank means of the loop's laps) fill the step; the exposed comm within
    them is the strategy's own figure (slowest rank), so a straggler's extra compute shows as the
    others' wait, as a user of DDP experiences it, and torch DDP, which waits inside backward(), is
    split like the strategies that wait in finish_gradient_synchronization(). A sharded
    optimizer's wait for its own communication (zero1's parameter broadcasts) is exposed comm
    taken out of the optimizer phase, which keeps only the update itself. The tensor-parallel axis's
    collectives block inside forward and backward: their time (the lab's, measured) is taken out of the
    compute (`tp_comm_mean_ms`); torch's TP, unseen, stays in it. A pipeline's idle time (its span less its
    actions' compute, mean over stage ranks: analysis/pipeline.py) is taken out too (`pp_idle_mean_ms`)."""
    cfg = res.get("config") or {}
    fwd_bwd, sync, exposed, opt, step = (_mean(res, f.key) for f in (FWD_BWD, SYNC, EXPOSED, OPTIMIZER, STEP_TIME))
    compute = other = None
    tp_comm = _mean(res, TP_COMM.key)
    pipeline = pipeline_record(res)
    if None not in (fwd_bwd, sync, exposed, opt, step):
        in_optimizer = min(_mean(res, EXPOSED_OPTIMIZER.key) or 0.0, exposed, opt)
        in_sync = min(exposed - in_optimizer, fwd_bwd + sync)
        compute, opt, exposed = fwd_bwd + sync - in_sync, opt - in_optimizer, in_sync + in_optimizer
        compute -= min(tp_comm or 0.0, compute)
        compute -= min(pipeline["pp_idle_mean_ms"] or 0.0, compute)
        other = max(0.0, step - compute - exposed - opt - (tp_comm or 0.0) - (pipeline["pp_idle_mean_ms"] or 0.0))
    return {
        "strategy": _get(cfg, "strategy", "name"), "bucket_mb": _get(cfg, "strategy", "bucket_mb"),
        "model": _get(cfg, "model", "name"), "world_size": cfg.get("world_size"), **mesh_record(res), **pipeline,
        **context_record(res), **experts_record(res),
        "backend": _get(res, "env", "backend") or _get(cfg, "backend", "name"),
        "network": _get(cfg, "network", "name", default="host"), "link_gbps": _get(cfg, "network", "gbps"),
        "measured_steps": _get(res, "summary", "measured_steps"),
        **{f.record_key(stat): _get(res, "summary", f.key, stat) for f in training_figures() for stat in f.record},
        "compute_mean_ms": compute, "exposed_mean_ms": exposed, "optimizer_mean_ms": opt, "other_mean_ms": other,
        "tp_comm_mean_ms": tp_comm,
        "overlap_pct": _get(res, "summary", "overlap_pct"),
        "trace_overlap_pct": _get(res, "summary", "trace_overlap", "overlap_pct"),
        "compile_s": _get(res, "summary", "compile", "compile_s"),
        "collectives_per_step": _get(res, "summary", "collectives_per_step"),
        "straggler": straggler_text(_get(res, "summary", "straggler")),
        "injected": injected_text(_get(res, "summary", "injected"), _get(res, "summary", "injected_link")),
        "comm_bytes_per_step": _get(res, "summary", "comm_bytes_per_step"),
        "opt_state_mib_per_rank": (lambda v: None if v is None else v / MiB)(
            _get(res, "summary", "memory", "optimizer_state_max_rank")),
        **memory_record(res),
    }


def mesh_record(res: dict) -> dict:
    """The job's mesh (`dp x tp`: summary.mesh, or its config's for a job that wrote none) and the tensor-parallel
    axis's collectives per step: the lab's measured in every step, torch's counted in one (summary.mesh.tp_counted)."""
    cfg, mesh = res.get("config") or {}, _get(res, "summary", "mesh") or {}
    if not mesh.get("label") and cfg.get("world_size"):
        from ddp_lab.spec.parallel import layout_of

        mesh = layout_of(cfg).describe()
    counted = mesh.get("tp_counted") or {}
    per_step = _get(res, "summary", "tp_collectives_per_step")
    tp_bytes = _get(res, "summary", "tp_comm_bytes_per_step")
    return {"mesh": mesh.get("label"), "tp": mesh.get("tp"), "tp_impl": mesh.get("tp_impl"),
            "sequence_parallel": mesh.get("sequence_parallel"),
            "tp_collectives_per_step": per_step if per_step is not None else counted.get("calls"),
            "tp_comm_mib_per_step": _mib(tp_bytes if tp_bytes is not None else counted.get("bytes")),
            "tp_params_held_pct": (lambda f: None if f is None else 100 * f)(
                _get(res, "summary", "memory", "tp_param_fraction"))}


def context_record(res: dict) -> dict:
    """Context parallelism's figures of a job (summary.mesh.context, its last step's bytes): what one step sent over
    the cp axis (MiB, forward and backward), the ring's exchange alone and the share of it the blocks hid, the
    busiest rank's attention work over the mean (counted in pairs, measured in time)."""
    context = _get(res, "summary", "mesh", "context") or {}
    last = (res.get("steps") or [{}])[-1]
    sent = [last.get(f.key) for f in (CP_BYTES_FORWARD, CP_BYTES_BACKWARD)]
    return {"cp": context.get("cp"), "cp_impl": context.get("impl"),
            "cp_mib_per_step": None if None in sent else _mib(sum(sent)),
            "cp_exposed_busiest_ms": context.get("exposed_ms"), "cp_alone_ms": context.get("exchange_alone_ms"),
            "cp_hidden_pct": context.get("hidden_pct"),
            "cp_imbalance_counted": context.get("imbalance_counted"),
            "cp_imbalance_measured": context.get("imbalance_measured")}


def experts_record(res: dict) -> dict:
    """Expert parallelism's figures of a job (summary.mesh.experts, its last step's bytes): ep, its implementation,
    what one step sent to the other ep ranks (MiB), the experts' parameters this rank held."""
    experts = _get(res, "summary", "mesh", "experts") or {}
    last = (res.get("steps") or [{}])[-1]
    return {"ep": experts.get("ep"), "ep_impl": experts.get("impl"), "ep_mib_per_step": _mib(last.get(EP_BYTES.key)),
            "expert_mib_per_rank": _mib(experts.get("expert_param_bytes"))}


def straggler_text(found: dict | None) -> str | None:
    """The verdict in a cell: 'rank 1: 31.2 ms (24%), compute', 'rank 3 (node 1): ...', 'node 1: ..., link';
    '-' (None) where no rank or node stands out."""
    if not found or (found.get("rank") is None and found.get("node") is None):
        return None
    who = f"node {found['node']}" if found.get("rank") is None else (
        f"rank {found['rank']}" + (f" (node {found['node']})" if found.get("node") is not None else ""))
    cause = f", {found['cause']}" if found.get("cause") else ""
    return f"{who}: {found['cost_ms']:.1f} ms ({100 * found['share']:.0f}%){cause}"


def injected_text(fault: dict | None, link: dict | None = None) -> str | None:
    """The injected fault and slow link in a cell ('slow 1.3x rank 1', 'node 1 link 0.25 Gbit/s from step 8'),
    so an injected run is never read as a clean one."""
    parts = []
    if fault:
        what = f"slow {fault['slowdown']:g}x" if fault["kind"] == "slow" else fault["kind"]
        parts.append(f"{what} node {fault['node']}" if fault.get("node") is not None else
                     f"{what} rank {fault['rank']}" if fault["rank"] >= 0 else f"{what} every rank")
    if link:
        parts.append(f"node {link['node']} link {link['gbps']:g} Gbit/s"
                     + (f" from step {link['made_in_step']}" if link.get("made_in_step") else ""))
    return "; ".join(parts) or None


def _mib(value):
    return None if value is None else value / MiB


def memory_record(res: dict) -> dict:
    """The largest rank's model state (MiB) beside the ZeRO paper's figure for the job's stage, and what
    the strategy keeps beside it (`strategy_state`, `state_total`: rank/memory.py).

    The paper's figure is recomputed here from the recorded parameter count, stage, dtype and world
    size by arithmetic/zero_bytes.py's model_state_bytes, the one function the rank's own `expected` and the
    calculator's rows also come from. Empty values for jobs without memory figures.
    """
    memory = _get(res, "summary", "memory") or {}
    parts = memory.get("model_state_max_rank_parts") or {}
    out = {"zero_stage": memory.get("zero_stage"), "state_dtype": memory.get("dtype"),
           "params_mib_per_rank": _mib(parts.get("params")), "grads_mib_per_rank": _mib(parts.get("grads")),
           "opt_mib_per_rank": _mib(parts.get("optimizer_state")),
           "model_state_mib_per_rank": _mib(memory.get("model_state_max_rank")),
           "strategy_state_mib_per_rank": _mib(memory.get("strategy_state_max_rank")),
           "state_total_mib_per_rank": _mib(memory.get("state_total_max_rank")),
           "live_tensors_mib": _mib(memory.get("live_tensor_bytes_max_rank")),
           "activations_mib_per_rank": _mib(memory.get("activation_peak_bytes_max_rank")),
           "paper_mixed_model_state_mib": _mib(memory.get("paper_mixed_total")),
           "peak_gathered_mib": _mib(memory.get("peak_gathered_bytes_max_rank")),
           "max_memory_allocated_mib": _mib(memory.get("max_memory_allocated_max_rank")),
           "paper_params_mib": None, "paper_grads_mib": None, "paper_opt_mib": None, "paper_model_state_mib": None,
           "model_state_vs_paper": None}
    world_size = memory.get("shard_ranks") or (res.get("config") or {}).get("world_size")  # hsdp: its shard group
    if None in (memory.get("num_params"), memory.get("zero_stage"), world_size):
        return out
    paper = model_state_bytes(memory["num_params"], memory.get("dtype") or "fp32", world_size, memory["zero_stage"])
    out.update(paper_params_mib=paper["params"] / MiB, paper_grads_mib=paper["grads"] / MiB,
               paper_opt_mib=paper["optimizer"] / MiB, paper_model_state_mib=paper["total"] / MiB)
    if memory.get("model_state_max_rank") is not None:
        out["model_state_vs_paper"] = memory["model_state_max_rank"] / paper["total"]
    return out


def collective_record(res: dict) -> dict:
    cfg, s = res.get("config") or {}, res.get("summary") or {}
    op = _get(cfg, "task", "op")
    # reduce-scatter and all-gather say which implementation ran (backend.collectives): ring or native
    implementation = s.get("collectives") if op in ("reduce_scatter", "all_gather") else None
    return {
        "op": op, "size_mb": _get(cfg, "task", "size_mb"), "bytes": s.get("bytes"),
        "collectives": implementation, "barrier": _get(cfg, "task", "barrier", default=True),
        "op_label": collective_label(cfg.get("task") or {}) + (f" {implementation}" if implementation else ""),
        "world_size": cfg.get("world_size"),
        "backend": s.get("backend") or _get(res, "env", "backend") or _get(cfg, "backend", "name"),
        "device": s.get("device"), "iters": s.get("iters"),
        **{f"latency_{k}_ms": _get(s, LATENCY.key, k) for k in ("p50", "mean", "std", "min", "max", "p90")},
        ALGBW.key: s.get(ALGBW.key), BUSBW.key: s.get(BUSBW.key),
    }


def record(name: str, res: dict) -> dict:
    task = task_of(res)
    head = {"job": name, "task": task, "status": res.get("status", "missing"), "error": res.get("error"),
            "label": row_label(res)}
    return {**head, **(collective_record(res) if task == "allreduce" else train_record(res))}


def bucket_groups(records: list[dict]) -> dict:
    """Training jobs that differ only in strategy.bucket_mb: {(strategy, model, ranks, backend): [records]}."""
    train = [r for r in records if r["task"] != "allreduce" and r.get("bucket_mb") is not None]
    # A job that failed early recorded no resolved backend ('auto'): it belongs with its sweep.
    resolved = {}
    for r in train:
        if r.get("backend") not in (None, "auto"):
            resolved.setdefault((r["strategy"], r["model"], r["world_size"]), r["backend"])
    groups = defaultdict(list)
    for r in train:
        base = (r["strategy"], r["model"], r["world_size"])
        backend = r["backend"] if r.get("backend") not in (None, "auto") else resolved.get(base, r.get("backend"))
        groups[(*base, backend)].append(r)
    return {k: sorted(v, key=lambda r: r["bucket_mb"]) for k, v in groups.items()
            if len({r["bucket_mb"] for r in v}) >= 2}


def job_records(runs: list[tuple[str, dict]], target_loss: float | None = None,
                reference: str | None = None) -> list[dict]:
    """Every job's record, with the accuracy figures (analysis/accuracy.py: against each row's exact
    reference, `reference` naming one, and `target_loss` if given), the wire bytes in MiB, and the step
    beside the floor's and torch's reference's of the same sweep (`vs_floor`, `vs_torch`)."""
    figures = accuracy(runs, target_loss, reference)
    records = [record(name, res) for name, res in runs]
    for rec in records:
        rec.update(figures.get(rec["job"], {}))
        if rec.get("comm_bytes_per_step") is not None:
            rec["comm_mib_per_step"] = rec["comm_bytes_per_step"] / MiB
    add_step_ratios(records, [res for _, res in runs])
    return records


def same_work(res: dict) -> tuple:
    """What two training jobs must share for their steps to compare: the model and its shape, the ranks, the
    backend, the batch, the precision, the data, whether it was compiled (train.compile changes the compute) and
    its mesh (tensor parallelism splits the compute; spec/labels.py's `mesh_label`). The strategy, its knobs and
    the measurement switches may differ."""
    cfg = res.get("config") or {}
    train = cfg.get("train") or {}
    from ddp_lab.spec.labels import mesh_label

    return (_get(cfg, "model", "name"), _get(cfg, "model", "context_length"), cfg.get("world_size"),
            _get(res, "env", "backend") or _get(cfg, "backend", "name"), train.get("batch_size"),
            train.get("grad_accum_steps"), str(train.get("precision") or "fp32"), _get(cfg, "data", "name"),
            bool(train.get("compile")), mesh_label(cfg))


def per_collective_on(res: dict) -> bool:
    return _get(res, "config", "measure", "per_collective", default=True) is not False


def add_step_ratios(records: list[dict], results: list[dict]) -> None:
    """`vs_floor`: the step p50 over the floor's (`strategy=none`, the same work, in the sweep); `vs_torch`: over
    torch's reference of the strategy (its spec's `torch_reference`), the same work with the same measurement
    switch, the same bucket size where one was swept; `vs_torch_tp`: a job of the lab's tensor parallelism over
    the same job on torch's (`parallel.tp_impl=torch`, all else alike); `vs_torch_pp` the same for a pipeline
    (`parallel.pp_impl=torch`: torch's schedule on the same stages). None where the sweep has no such job."""
    from ddp_lab.spec.strategies import SPECS

    work = [same_work(res) if rec["task"] == "train" else None for rec, res in zip(records, results)]
    ok = [(rec, key, per_collective_on(res)) for rec, res, key in zip(records, results, work)
          if rec["task"] == "train" and rec["status"] == "ok" and rec.get("step_p50_ms")]
    floors = {key: rec["step_p50_ms"] for rec, key, _ in ok
              if SPECS.get(rec["strategy"]) is not None and not SPECS[rec["strategy"]].synchronizes}
    def twin(impl_key: str):
        """torch's job of an axis (`-tp_impl=torch`, `-pp_impl=torch` in its label) by the lab's job's key."""
        mark = f"-{impl_key}=torch"
        return {(rec["label"].replace(mark, ""), key[:-1] + (key[-1].replace(mark, ""),)): rec["step_p50_ms"]
                for rec, key, _ in ok if mark in rec["label"]}

    torch_tp, torch_pp = twin("tp_impl"), twin("pp_impl")
    for rec, res, key in zip(records, results, work):
        rec["vs_floor"] = rec["vs_torch"] = rec["vs_torch_tp"] = rec["vs_torch_pp"] = None
        if rec["task"] != "train" or not rec.get("step_p50_ms"):
            continue
        if rec.get("tp_impl") == "lab" and (rec["label"], key) in torch_tp:
            rec["vs_torch_tp"] = rec["step_p50_ms"] / torch_tp[rec["label"], key]
        if rec.get("pipeline") and "-pp_impl=" not in rec["label"] and (rec["label"], key) in torch_pp:
            rec["vs_torch_pp"] = rec["step_p50_ms"] / torch_pp[rec["label"], key]
        floor = floors.get(key)
        rec["vs_floor"] = rec["step_p50_ms"] / floor if floor else None
        spec = SPECS.get(rec["strategy"])
        wanted = spec.torch_reference if spec is not None else None
        stamped = per_collective_on(res)
        refs = [(r, k) for r, k, on in ok if r["strategy"] == wanted and k == key and on == stamped]
        refs.sort(key=lambda pair: pair[0].get("bucket_mb") != rec.get("bucket_mb"))
        if refs:
            rec["vs_torch"] = rec["step_p50_ms"] / refs[0][0]["step_p50_ms"]
