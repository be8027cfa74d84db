"""A user's mistake ends before any rank starts: one clear line, non-zero exit, no traceback.

Every case runs through `check_command_line`, the check launch.py makes before Hydra's app starts,
in this process (a fraction of a second each); a handful, one per kind of mistake, also run as a
user types them, through launch.py (seconds each)."""

import subprocess
import sys
import time

import pytest
import torch

from ddp_lab.config import register_configs
from ddp_lab.launcher.preflight import EXIT_BAD_INPUT, check_command_line
from tests.helpers.launching import ROOT, launch

register_configs()

CASES = {  # overrides -> a phrase the message must contain (it says what to change)
    "world_size=0": "world_size must be a positive",
    "world_size=-2": "world_size must be a positive",
    "world_size=two": "world_size",
    "strategy=nonexistent": "strategy",
    "model=huge": "model",
    "train.batch_size=7": "does not divide by world_size",
    "train.steps=0": "train.steps must be >= 1",
    "train.stepz=3": "stepz",
    "model.context_length=0": "model.context_length must be >= 1",
    "train.lr=fast": "lr",
    "logger.mode=sometimes": "mode",
    "model=xl world_size=4": "needs about",
    "task=dance": "task",
    "strategy=flat strategy.bucket_mb=0": "strategy.bucket_mb is not a knob of strategy=flat",
    "strategy=bucketed strategy.bucket_mb=-5": "bucket_mb must be > 0",
    "strategy=bucketed strategy.bucket_mb=big": "bucket_mb",
    "strategy=zero1 strategy.grad_sync=magic": "Invalid value 'magic', expected one of [naive, flat,",
    "strategy=zero1 strategy.comm=pigeon": "Invalid value 'pigeon', expected one of [allreduce_broadcast,",
    "task=allreduce task.op=all_to_all": "Invalid value 'all_to_all', expected one of [all_reduce,",
    "backend=mpi": "Available options in 'backend': auto, gloo, nccl",
    "backend.collectives=tree": "Invalid value 'tree', expected one of [auto, ring, native]",
    "strategy=bucketed strategy.node_size=2": "strategy.node_size applies to strategy.all_reduce=two_level only",
    "strategy=bucketed strategy.all_reduce=two_level strategy.node_size=3 world_size=4":
        "does not split into node groups of 3 ranks",
    "strategy=bucketed strategy.all_reduce=tree": "Invalid value 'tree', expected one of [flat, two_level]",
    "+train.stpes=5": "unknown key train.stpes",
    "strategy=naive strategy.bucket_mb=10": "strategy.bucket_mb is not a knob of strategy=naive",
    "strategy=bucketed strategy.comm=reduce_scatter": "strategy.comm is not a knob of strategy=bucketed",
    "strategy=zero2 strategy.bucket_mb=0": "bucket_mb must be > 0",
    "strategy=zero2 strategy.bucket_mb=-1": "bucket_mb must be > 0",
    "strategy=zero2 strategy.grad_sync=flat": "strategy.grad_sync is not a knob of strategy=zero2",
    "strategy=zero2 strategy.comm=reduce_scatter": "strategy.comm is not a knob of strategy=zero2",
    "strategy=torch_ddp strategy.comm_dtype=bf16 backend=gloo": "torch allows only on CUDA with NCCL 2.10+",
    "strategy=fsdp strategy.policy=rows": "Invalid value 'rows', expected one of [linear_embedding, all_params]",
    "strategy=fsdp train.precision=fp8": "Invalid value 'fp8', expected one of [fp32, bf16, fp16]",
    "strategy=bucketed strategy.reshard_after_forward=false":
        "strategy.reshard_after_forward is not a knob of strategy=bucketed",
    "strategy=fsdp model._target_=ddp_lab.check.models.NothingToShard": "has no parameter the policy shards",
    "strategy=powersgd strategy.rank=0": "strategy.rank must be >= 1, got 0",
    "strategy=powersgd strategy.start_iter=-1": "strategy.start_iter must be >= 0, got -1",
    "strategy=local_sgd strategy.sync_every=0": "strategy.sync_every must be >= 1, got 0",
    "strategy=local_sgd strategy.outer=adam": "Invalid value 'adam', expected one of [none, nesterov]",
    "strategy=local_sgd strategy.comm_dtype=fp16": "strategy.comm_dtype does not apply to strategy=local_sgd",
    "strategy=zero1 strategy.comm=reduce_scatter strategy.bucket_mb=10":
        "strategy.bucket_mb=10.0 has no effect with strategy.comm=reduce_scatter",
    "strategy=hsdp strategy.shard_size=3 world_size=4": "strategy.shard_size=3 does not divide world_size=4",
    "strategy=fsdp_torch strategy.shard_size=3 world_size=4": "strategy.shard_size=3 does not divide world_size=4",
    "strategy=hsdp strategy.shard_size=0": "strategy.shard_size must be >= 1, got 0",
    "network=emulated world_size=3": "world_size=3 does not split evenly over network.nodes=2",
    "network=emulated network.nodes=0": "network.nodes must be >= 1",
    "network=emulated network.gbps=0": "network.gbps must be in (0, 100000] Gbit/s",
    "network=emulated network.slow_node=1": "network.slow_node and network.slow_gbps go together",
    "network=emulated network.slow_node=2 network.slow_gbps=0.5": "network.slow_node must be a node in [0, 1]",
    "network=emulated network.slow_node=0 network.slow_gbps=0": "network.slow_gbps must be in (0, 100000] Gbit/s",
    "network=emulated fault.kind=slow fault.node=2": "fault.node=2 must be a node in [0, 1]",
    "fault.kind=slow fault.node=1": "fault.node=1 must be a node in [0, 0]",
    "network=emulated network.slow_step=2": "network.slow_step needs network.slow_node and network.slow_gbps",
    "network=emulated network.slow_node=1 network.slow_gbps=0.5 network.slow_step=20 train.steps=20":
        "network.slow_step must be a step of the run, in [1, 19]",
    "network=emulated network.slow_node=1 network.slow_gbps=0.5 network.slow_step=2 network.latency_ms=1":
        "network.slow_step with network.latency_ms",
    "network=emulated launcher.nnodes=2 world_size=4 launcher.rdzv_endpoint=h:1": "use launcher.nnodes=1",
    "network=emulated backend=nccl": "network=emulated runs gloo between namespaces",
    "network=lan": "Available options in 'network': emulated, host",
    "network=host network.gbps=1": "gbps",
    "strategy=zero1 strategy.comm=reduce_scatter strategy.grad_sync=naive":
        "strategy.grad_sync=naive has no effect with strategy.comm=reduce_scatter",
    "checkpoint.every=-1": "checkpoint.every must be >= 0 steps",
    "checkpoint.keep=-1": "checkpoint.keep must be >= 0",
    "launcher.max_restarts=-1": "launcher.max_restarts must be >= 0",
    "launcher.max_restarts=1": "checkpoint.every=0 writes none: set checkpoint.every",
    "checkpoint.async_save=true": "checkpoint.every=0 asks for none: set checkpoint.every",
    "checkpoint.async=true": "checkpoint.async_save",
    "checkpoint.load=/no/such/job": "checkpoint.load=/no/such/job: no such folder",
    "fault.kind=slow fault.slowdown=1": "fault.slowdown=1.0 must be > 1 (times as long)",
    "train.seed=-1": "train.seed must be in [0, 4294967293]",
    "model.context_length=1000000": "its logits alone need",
    "model.num_layers=1000000000": "needs about",
    "model.d_model=1000000000000 model.num_heads=1": "cannot be built from its config",
    "task=allreduce task.warmup_iters=21": "task.warmup_iters must be in [0, task.iters=20]",
    "train.eval_batches=1000000000000": "each rank keeps its held-out batches in memory",
    "train.compile=true train.warmup_steps=0": "train.compile=true compiles in the first step",
    "train.activation_checkpointing=selective parallel.pp=2 parallel.pp_schedule=zero_bubble":
        "torch's selective checkpoint allows one backward per region",
    "train.compile=true parallel.tp=2 parallel.tp_impl=torch": "Dynamo fails tracing those views ('Mixing fake modes",
    "train.compile=true parallel.cp=2 parallel.cp_impl=torch": "Dynamo fails tracing its ring attention",
    "measure.grad_error=true parallel.pp=2 parallel.pp_schedule=zero_bubble": "no post-accumulate-grad hook fires",
    "train.activation_checkpointing=some": "train.activation_checkpointing",
    "train.compile=true train.compile_backend=tvm": "train.compile_backend must be one of inductor, aot_eager, eager",
    "train.optimizer=sgd": "Invalid value 'sgd', expected one of [adamw, muon]",
    "strategy=zero2 train.optimizer=muon": "train.optimizer=muon needs an optimizer over whole parameters, and "
                                           "strategy=zero2's updates slices of them",
    "strategy=fsdp train.optimizer=muon": "strategy=fsdp's updates slices of them",
    "strategy=demo train.optimizer=muon": "strategy=demo's updates slices of them, or is its own (demo)",
    "strategy=demo strategy.chunk=4 strategy.topk=17": "strategy.topk=17 must be in [1, chunk² = 16]",
    "strategy=demo strategy.chunk=200": "strategy.chunk must be <= 181",
    "strategy=demo strategy.decay=1": "strategy.decay must be in [0, 1)",
    "strategy=demo train.precision=fp16": "strategy=demo takes train.precision fp32 or bf16",
    "strategy=demo strategy.comm_dtype=bf16": "strategy.comm_dtype does not apply to strategy=demo",
    "strategy=local_sgd strategy.fragments=5": "strategy.fragments=5 must be <= strategy.sync_every=4",
    "strategy=local_sgd strategy.sync_every=64 strategy.fragments=40": "is more than the model's",
    "strategy=local_sgd strategy.delay=4": "strategy.delay=4 must be in [0, strategy.sync_every=4)",
    "strategy=local_sgd strategy.sync_every=1 strategy.delay=1":
        "strategy.delay=1 must be in [0, strategy.sync_every=1)",
    "strategy=local_sgd strategy.mix=0.5": "strategy.mix=0.5 needs strategy.delay > 0",
    "strategy=local_sgd strategy.delay=1 checkpoint.every=2": "a checkpoint would miss the all-reduces in flight",
    "strategy=local_sgd strategy.outer_topk=8 strategy.outer=nesterov": "takes strategy.outer=none",
    "strategy=local_sgd strategy.outer_topk=17 strategy.outer_chunk=4": "strategy.outer_topk=17 must be in [1, "
                                                                        "outer_chunk² = 16]",
    "strategy=local_sgd strategy.outer_topk=8 strategy.outer_bits=8": "strategy.outer_bits must be 2 or 32",
    # a mixture of experts and expert parallelism (spec/experts.py)
    "parallel.ep=2": "parallel.ep=2 splits a mixture's experts, and model=tiny has none",
    "model=tiny_moe parallel.ep=4": "parallel.ep=4 borrows its ranks from the data-parallel ones (dp x cp = 2)",
    "model=tiny_moe world_size=3 train.batch_size=6 parallel.ep=3": "parallel.ep=3 must divide model.experts=8",
    "model=tiny_moe model.top_k=9": "model.top_k=9 must be between 1 and model.experts=8",
    "model=tiny_moe model.capacity_factor=0": "model.capacity_factor must be > 0 (or null: dropless), got 0",
    "model=tiny_moe model.router=relu": "model.router must be one of softmax, sigmoid, got relu",
    "model=tiny_moe model.d_ff=1024": "model.d_ff=1024: a mixture has no dense feed-forward",
    "model=tiny_moe parallel.ep=2 strategy=zero2": "parallel.ep=2: strategy=zero2 does not run under expert "
                                                   "parallelism",
    "model=tiny_moe world_size=4 parallel.ep=2 parallel.tp=2": "model=tiny_moe with parallel.tp=2: the experts are "
                                                               "not split by tensor parallelism here",
    "model=tiny_moe world_size=4 parallel.pp=2": "model.balance=aux_loss with parallel.pp=2",
    "model=tiny_moe parallel.ep=2 parallel.ep_impl=torch train.precision=fp16": "parallel.ep_impl=torch runs "
                                                                                "torch._grouped_mm",
    # the mesh (spec/parallel.py)
    "parallel.tp=3": "parallel.tp=3 does not divide world_size=2",
    "parallel.tp=0": "parallel.tp must be >= 1",
    "parallel.tp=2 world_size=4 model.num_heads=7 model.d_model=252": "splits 7 heads over parallel.tp=2: "
                                                                      "model.num_heads must divide",
    "parallel.tp=4 world_size=4 model.d_ff=1022": "model.d_ff must divide by parallel.tp",
    "parallel.tp=2 world_size=4 strategy=hsdp": "strategy=hsdp does not run on a mesh's data-parallel axis",
    "parallel.tp=2 world_size=4 strategy=fsdp_torch strategy.shard_size=2": "FSDP2's hybrid sharding",
    "parallel.tp=2 model.context_length=63 parallel.sequence_parallel=true": "model.context_length=63 does not "
                                                                             "divide by it",
    "parallel.sequence_parallel=true": "it needs parallel.tp > 1",
    "parallel.tp=2 world_size=6 train.batch_size=8": "does not divide by the data-parallel ranks (world_size / "
                                                     "(tp x pp x cp) = 3)",
    "parallel.tp=2 parallel.tp_impl=jax": "Invalid value 'jax', expected one of [lab, torch]",
    "parallel.tp=2 task=allreduce": "task=allreduce has no model",
    # the pipeline (spec/pipeline.py)
    "parallel.pp=3": "does not divide world_size=2",
    "parallel.pp=2 parallel.pp_schedule=pipedream": "parallel.pp_schedule must be one of gpipe, 1f1b, "
                                                    "interleaved_1f1b, zero_bubble, got pipedream",
    "parallel.pp=2 parallel.microbatches=3": "does not divide",
    "parallel.microbatches=4": "parallel.pp=1 is none: set parallel.pp > 1 (train.grad_accum_steps",
    "parallel.pp=2 parallel.stages_per_rank=2": "use parallel.pp_schedule=interleaved_1f1b",
    "parallel.pp=2 parallel.pp_schedule=interleaved_1f1b parallel.stages_per_rank=2 parallel.microbatches=2 "
    "model.num_layers=3": "4 stages, more than the model's 3 blocks",
    "parallel.pp=2 parallel.stage_layers=[1,1]": "must give every stage at least one of the model's 4 blocks",
    "parallel.stage_layers=[2,2]": "parallel.stage_layers splits a pipeline's blocks, and parallel.pp=1 is none",
    "parallel.pp=2 parallel.stage_layers=even": "parallel.stage_layers must be a count of blocks per stage, or auto",
    "parallel.pp=2 train.grad_accum_steps=2": "a pipeline's micro-batches are its accumulation",
    "parallel.pp=2 parallel.pp_impl=torch parallel.microbatches=1": "torch's Schedule1F1B needs "
                                                                    "parallel.microbatches >= its 2 stages",
    "parallel.pp=2 world_size=4 strategy=fsdp": "strategy=fsdp does not run under a pipeline",
    "parallel.pp=2 task=allreduce": "task=allreduce has no model",
    # context parallelism (spec/context.py)
    "parallel.cp=3": "parallel.cp=3 does not divide world_size=2",
    "parallel.cp=0": "parallel.cp must be >= 1",
    "parallel.cp=2 model.context_length=63": "model.context_length=63 does not divide by 2",
    "parallel.cp=2 parallel.cp_impl=zigzag model.context_length=66": "2 x parallel.cp = 4 chunks",
    "parallel.cp=2 parallel.cp_impl=torch model.context_length=66": "does not divide by 4 (never silently unbalanced",
    "world_size=4 parallel.cp=4 parallel.cp_impl=ulysses model.num_heads=2 model.d_model=128": "model.num_heads=2 "
                                                                                               "does not divide by 4",
    "world_size=4 parallel.cp=2 parallel.tp=2 parallel.cp_impl=ulysses model.num_heads=2 model.d_model=128":
        "model.num_heads=2 does not divide by 4",
    "world_size=4 parallel.cp=4 parallel.cp_impl=hybrid parallel.cp_ulysses=4": "must divide parallel.cp=4 and be "
                                                                                "smaller than it",
    "parallel.cp_ulysses=4": "it is read with parallel.cp_impl=hybrid and parallel.cp > 1 only",
    "parallel.cp=2 parallel.cp_impl=ring2": "Invalid value 'ring2'",
    "parallel.cp=2 strategy=none": "strategy=none synchronizes nothing",
    "world_size=4 parallel.cp=2 strategy=hsdp": "parallel.cp=2: strategy=hsdp does not run on a mesh",
    "parallel.cp=2 model=toy": "model=toy does not say how its attention exchanges a split sequence",
    "parallel.cp=2 task=allreduce": "task=allreduce has no model",
    "model=xxl_ffn": "a model for the calculator",
    f"hydra.searchpath=[file://{ROOT / 'examples' / 'conf'}] model=tied_gpt parallel.tp=2 "
    "parallel.sequence_parallel=true": "does not run on sequence shards",
}


# One per kind: Hydra's types, options and keys; a validation rule; the memory check; a knob rule.
THROUGH_LAUNCH = ["world_size=two", "strategy=nonexistent", "+train.stpes=5", "train.batch_size=7",
                  "model=xl world_size=4", "strategy=local_sgd strategy.comm_dtype=fp16",
                  "model.context_length=1000000", "parallel.tp=3", "parallel.pp=2 parallel.microbatches=3",
                  "model=tiny_moe parallel.ep=4"]
ANSWERED_S = 2.0  # a refusal that needs no torch, from `python launch.py` to its exit, on this machine


@pytest.mark.parametrize("overrides", list(CASES), ids=list(CASES))
def test_bad_input_is_refused_by_the_pre_launch_check(overrides, tmp_path, capsys):
    args = [*overrides.split(), f"hydra.run.dir={tmp_path / 'run'}"]
    with pytest.raises(SystemExit) as exit_:
        check_command_line(ROOT / "conf", "config", args)
    assert exit_.value.code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert CASES[overrides] in err
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line
    assert not (tmp_path / "run").exists()


def test_a_strategy_that_cannot_run_compiled_says_why_before_launch(monkeypatch, tmp_path, capsys):
    """Every strategy of the README's install compiles; DeepSpeed's and torchft's refuse (their specs say why, and
    their extras are checked first). The refusal itself, on a spec given one."""
    from ddp_lab.spec.strategies import SPECS

    monkeypatch.setattr(SPECS["bucketed"], "compile_refusal", "its hooks are not proven compiled (a test's reason)")
    with pytest.raises(SystemExit) as exit_:
        check_command_line(ROOT / "conf", "config", ["train.compile=true", "strategy=bucketed",
                                                     f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_.value.code == EXIT_BAD_INPUT
    assert capsys.readouterr().err == ("error: train.compile=true: strategy=bucketed cannot run compiled here: its "
                                       "hooks are not proven compiled (a test's reason)\n")


@pytest.mark.slow
@pytest.mark.parametrize("overrides", THROUGH_LAUNCH)
def test_bad_input_is_refused_before_launch(overrides, tmp_path):
    start = time.perf_counter()
    proc = launch(*overrides.split(), tmp_path=tmp_path)
    seconds = time.perf_counter() - start
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout
    assert CASES[overrides] in proc.stderr
    assert not (tmp_path / "run" / "results.json").exists()  # no rank started
    assert not (tmp_path / "run" / "steps.jsonl").exists()
    if overrides in ("model.context_length=1000000", "parallel.tp=3"):  # never the job's work (its attention),
        # and the mesh's arithmetic needs no torch
        assert seconds <= ANSWERED_S, f"answered in {seconds:.2f} s"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs nccl needs")
def test_nccl_without_gpus_is_refused(tmp_path):
    proc = launch("backend=nccl", tmp_path=tmp_path)
    assert proc.returncode == 2
    assert "backend=nccl needs 2 CUDA GPUs" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_output_folder_that_cannot_be_made_is_refused(tmp_path):
    (tmp_path / "a_file").write_text("")
    for key, rest in (("hydra.run.dir", []), ("hydra.sweep.dir", ["strategy=naive,flat", "-m"])):
        args = [sys.executable, str(ROOT / "launch.py"), f"{key}={tmp_path / 'a_file' / 'out'}", *rest]
        proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert f"{key}=" in proc.stderr and "is a file, not a folder" in proc.stderr
        assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.slow
def test_bad_sweep_point_stops_sweep_before_any_job(tmp_path):
    proc = launch("model=toy", "world_size=2,3", tmp_path=tmp_path, multirun=True)
    assert proc.returncode == 2
    assert "world_size=3" in proc.stderr and "does not divide" in proc.stderr
    assert not list((tmp_path / "multirun").glob("*/results.json"))  # not even the good point ran


@pytest.mark.parametrize("euid, which, message", [
    (1000, "/usr/sbin/ip", "network=emulated needs root"),
    (0, None, "network=emulated needs iproute2 (ip, tc not found)"),
])
def test_emulated_network_without_root_or_iproute2_is_refused(euid, which, message, monkeypatch, tmp_path, capsys):
    from ddp_lab.launcher import emulated_network

    monkeypatch.setattr(emulated_network.os, "geteuid", lambda: euid)
    monkeypatch.setattr(emulated_network.shutil, "which", lambda tool: which)
    with pytest.raises(SystemExit) as exit_:
        check_command_line(ROOT / "conf", "config", ["network=emulated", "world_size=4",
                                                     f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_.value.code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
