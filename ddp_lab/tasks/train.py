"""task=train: train the chosen model with the chosen strategy and measure every step.

`run` reads top to bottom and never names a strategy nor an axis: `Parallelism` (ddp_lab/parallel/) applies
every axis beyond data parallelism to the model (tensor parallelism) and says which ranks the strategy
synchronizes over, which rows of each batch this rank reads, which loss the model's output takes and how one
step runs (a pipeline's schedule, or rank/step.py's `train_step`, which the parity tests and the benchmarks call
too); the strategy's spec (spec/strategies/) builds the runtime class that wraps the model and builds the
optimizer.
`train.precision` is a `Precision` (rank/precision.py): autocast around the forward, fp16's loss scaling around
backward and the optimizer step; a strategy whose spec `casts_itself` (fsdp) gets the dtype as `compute_dtype`
instead.
`measure.grad_error` adds a `GradErrorProbe` (rank/grad_error.py) between the sync and the step.
`train.compile` compiles the model in place after wrapping (the strategy's `compile_model`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_lab.arithmetic.stats import summarize_training
from ddp_lab.jobdir import MODEL
from ddp_lab.models import build_model
from ddp_lab.parallel import Parallelism
from ddp_lab.rank.checkpoints import Checkpoints, restarts
from ddp_lab.rank.data import BatchSource
from ddp_lab.rank.faults import maybe_inject_fault, slow_compute
from ddp_lab.rank.grad_error import GradErrorProbe
from ddp_lab.rank.held_out import HeldOutLoss
from ddp_lab.rank.memory import memory_report, memory_snapshot
from ddp_lab.rank.optimizers import optimizer_class
from ddp_lab.rank.precision import Precision
from ddp_lab.rank.process_group import seed_everything
from ddp_lab.rank.profiler import StepProfiler
from ddp_lab.rank.recompute import apply_activation_checkpointing
from ddp_lab.rank.step import loss_fn
from ddp_lab.rank.straggler import ArrivalWatch
from ddp_lab.rank.timing import StepTimer, reduce_over_ranks
from ddp_lab.spec.figures import LOSS, STEP_TIME, VAL_LOSS
from ddp_lab.spec.injection import injected
from ddp_lab.spec.strategies import spec_of


def compile_summary(cfg, steps: list[dict], summary: dict) -> dict | None:
    """`train.compile`: the backend, and how long compiling took: the first step's time beyond a measured step's
    p50 (the first step traces and compiles the forward and backward; it is a warm-up step, outside every other
    figure). None when the run did not compile, or did not run a step from the start (a resumed run)."""
    if not cfg.train.compile:
        return None
    first = steps[0] if steps and steps[0]["step"] == 0 else None
    p50 = (summary.get(STEP_TIME.key) or {}).get("p50")
    return {"backend": str(cfg.train.compile_backend),
            "first_step_ms": first[STEP_TIME.key] if first else None,
            "compile_s": max(0.0, first[STEP_TIME.key] - p50) / 1e3 if first and p50 is not None else None}


def wrap(spec, module, compute: str, device_type: str, lr: float, weight_decay: float, optimizer="adamw",
         group: dict | None = None):
    """The strategy of `spec` around `module`, its optimizer (`train.optimizer`, rank/optimizers.py, or an optimizer
    class: the parity tests' SGD) and the `Precision` of `compute` (fp32, bf16, fp16), as every job trains them
    (tests/parity/test_precision_every_strategy.py builds them here too); `group`: the keyword that puts the
    strategy on a mesh's data-parallel axis (`Parallelism.group()`), none for every rank."""
    casts_itself = spec.casts_itself and compute != "fp32"  # fsdp: the compute dtype instead of autocast
    model = spec.build(module, **({"compute_dtype": compute} if casts_itself else {}), **(group or {}))
    optimizer_cls = optimizer_class(optimizer) if isinstance(optimizer, str) else optimizer
    optimizer = model.make_optimizer(optimizer_cls, lr=lr, weight_decay=weight_decay)
    precision = Precision(compute, device_type, autocast=not casts_itself,  # on a mesh, ranks hold different pieces
                          agree_over_ranks=spec.zero_stage > 0 or not spec.reduces_gradients or bool(group))
    return model, optimizer, precision


def run(cfg, device: torch.device, recorder, job_dir) -> dict:
    rank = dist.get_rank()
    parallel = Parallelism(cfg, device)  # the mesh: which ranks share each axis
    seed_everything(cfg.train.seed + rank)  # different init per rank: the strategy's broadcast must fix it
    module = parallel.apply(build_model(cfg.model).to(device))  # TP: this rank's pieces (nothing without it)
    apply_activation_checkpointing(module, str(cfg.train.activation_checkpointing))  # before the strategy wraps it
    slow = slow_compute(cfg.fault, rank, module)  # fault.kind=slow: its hooks before the strategy's, or None
    probe = GradErrorProbe(module, parallel.averaging()) if cfg.measure.grad_error else None  # before the strategy
    spec, compute = parallel.data_parallel(spec_of(cfg.strategy)), str(cfg.train.precision)
    model, optimizer, precision = wrap(spec, module, compute, device.type, cfg.train.lr, cfg.train.weight_decay,
                                       str(cfg.train.optimizer), parallel.group())
    if cfg.train.compile:
        parallel.compile(model, str(cfg.train.compile_backend))  # lazy: the first step compiles (a warm-up step)
    facts = model.facts()  # a bucket plan, powersgd's compression ratio: in W&B now and in results.json
    data = BatchSource(cfg, *parallel.data_shard, device, parallel.splits, parallel.columns())  # its rows, tokens
    recorder.log_once({"num_params": parallel.whole_params, **facts, **data.facts()})
    memory = {"after_init": memory_snapshot(model, optimizer, device)}
    timer, steps = StepTimer(device), []
    arrivals = ArrivalWatch(cfg.train.warmup_steps)  # every rank's collective stamps: skew, the straggler
    held_out = HeldOutLoss(cfg, data, parallel.held_out_loss, also_drop=parallel.drop)
    checkpoints = Checkpoints(cfg, job_dir, {"strategy": spec.name, "model": cfg.model.name, **parallel.about()},
                              parallel.place)
    first = checkpoints.start(model, optimizer, precision)  # 0, or the step after the checkpoint it loaded

    def before_step():
        if step == cfg.train.steps - 1:  # optimizer state exists from the first step on
            memory["before_step"] = memory_snapshot(model, optimizer, device)
        if probe is not None:
            measured.update(probe.measure(optimizer))

    recorder.start(cfg.train.steps)
    with StepProfiler(cfg, job_dir, device) as profiler:  # no-op unless profile=true
        profiler.watch(model.module)
        for step in range(first, cfg.train.steps):
            maybe_inject_fault(cfg.fault, rank, step, slow)
            measured = {}  # grad_error, when measured
            timer.start()
            with arrivals.drawing():
                micro_batches = list(data.micro_batches(step))
            with parallel.counting(step):
                loss = parallel.step(model, optimizer, micro_batches, timer, before_step, precision=precision)
            step_ms = timer.stop_ms()
            profiler.end_step(timer, model.comm.intervals)
            skew = arrivals.step(step, model.comm, timer, step_ms)
            if step == cfg.train.steps - 1:
                memory["after_step"] = memory_snapshot(model, optimizer, device, census=True)
            saved = checkpoints.after_step(step, model, optimizer, precision)  # when due: its time and bytes
            record = {"step": step, **reduce_over_ranks({STEP_TIME.key: step_ms, LOSS.key: loss.item(), **timer.laps,
                                                         **model.comm.pop(), **parallel.pop(), **precision.record(),
                                                         **measured, **saved, **(slow.pop() if slow else {})},
                                                        device), **skew}
            if held_out.due(step) and not profiler.records(step):
                record[VAL_LOSS.key] = held_out.measure(model, precision)
            steps.append(record)
            recorder.step(record)
            profiler.step()
        if parallel.tensor is None:  # the whole model alone on one rank: what TP's pieces are not
            profiler.time_compute_alone(lambda: build_model(cfg.model).to(device), micro_batches[-1], loss_fn,
                                        precision.autocast)
    if held_out.due(steps[-1]["step"]) and VAL_LOSS.key not in steps[-1]:  # the last step was profiled
        steps[-1][VAL_LOSS.key] = held_out.measure(model, precision)
    if cfg.train.save_model:
        state = parallel.whole(model.full_state_dict())  # collective where parameters are sharded: every rank calls
        if rank == 0:
            torch.save(state, job_dir / MODEL)
    summary = summarize_training(steps, cfg.train.warmup_steps)
    summary["compile"] = compile_summary(cfg, steps, summary)
    memory["activations"] = parallel.activation_peak
    summary["memory"] = memory_report(memory, spec.zero_stage, parallel.held_params, compute,
                                      parallel.shard_ranks(spec), parallel.whole_params)
    summary["mesh"] = parallel.describe(cfg.train.warmup_steps)
    summary["trace_overlap"] = profiler.overlap  # None unless profile=true
    summary["strategy_facts"] = facts
    summary["resumed_from"] = checkpoints.loaded  # None, or the checkpoint this run started from
    summary["restarts"] = restarts(job_dir)  # launcher.max_restarts: each restart and what it cost
    summary["injected"] = injected(cfg.fault)  # None, or the fault this run was given: not a clean run
    summary["straggler"] = arrivals.verdict()  # the rank that made the others wait, or why none is named
    summary["exposure"] = arrivals.exposure()  # which collective each step waited for after backward, and why
    summary.update(data.facts())
    return {"summary": summary, "steps": steps}
