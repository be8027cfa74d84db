"""Checks on a composed config that Hydra's types cannot express, run before any rank starts.

Each failure is a `ConfigError` whose message is one line saying what to change; launch.py prints
it and exits 2. Types, unknown keys and unknown options are refused earlier by Hydra against
ddp_lab/config.py.

torch, and the modules that import it (models.facts, launcher.memory_estimate), are imported where a check
first needs them: a mistake found before (a key, a range, a knob, a context whose logits alone cannot fit) is
answered in about a second, not after torch's import (1.5 s on 2 cores).

No check does the job's work: sizes are judged from shapes (models/facts.py counts a model at small sizes and
scales), the model is built at full size only for `checkpoint.load`'s parameter names, after its memory passed.
tests/unit/test_config_search_*.py hold every numeric key of every schema to an answer within 2 s of check time.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from ddp_lab.arithmetic.bandwidth import bytes_per_rank
from ddp_lab.config import Config, data_parallel_size, micro_batch_size
from ddp_lab.data.files import DataError
from ddp_lab.data.split import open_data
from ddp_lab.launcher.emulated_network import netem_problem
from ddp_lab.launcher.emulated_network import problem as emulation_problem
from ddp_lab.spec.context import context_problem
from ddp_lab.spec.experts import moe_problem
from ddp_lab.spec.parallel import (
    checkpointing_problem,
    compile_problem,
    grad_error_problem,
    mesh_problem,
    plan_problem,
)
from ddp_lab.spec.pipeline import microbatches_of, pipeline_problem, schedule_problem
from ddp_lab.spec.strategies import SpecError, not_a_knob, spec_of
from ddp_lab.spec.strategy import StrategySpec, mesh_keys
from ddp_lab.units import MiB

if TYPE_CHECKING:
    import torch

SEED_MAX = 2**32 - 1  # numpy's largest seed
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # train.compile_backend: torch.compile's backends offered
MAX_GBPS = 1e5  # network.gbps: 100 Tbit/s, beyond any link, and within tc's 64-bit rates (bytes/s)
# Leave this share of the machine's free memory to the OS, Python and the launcher itself.
MEMORY_HEADROOM = 0.85
GLOO_SCRATCH = 2.0           # task=allreduce on CPU: peak memory per byte of benchmark buffers
RANK_BASELINE_BYTES = 2**28  # one rank's interpreter + torch, before any buffer


class ConfigError(ValueError):
    """A user's mistake in the config: reported as one line, never as a traceback."""


def first_line(exc: BaseException) -> str:
    """An exception as one line: the deepest cause's first line that says something (Hydra wraps a model's own
    error in a line naming the target)."""
    for e in (exc.__cause__, exc):
        lines = [line.strip() for line in str(e or "").splitlines() if line.strip()]
        if lines:
            return lines[-1] if len(lines) > 1 and lines[0].startswith("Error in call to target") else lines[0]
    return type(exc).__name__


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: DictConfig) -> None:
    _validate_keys(cfg)
    ws, nnodes = cfg.world_size, cfg.launcher.nnodes
    _require(ws >= 1, f"world_size must be a positive number of ranks, got {ws}")
    _require(nnodes >= 1, f"launcher.nnodes must be >= 1, got {nnodes}")
    _require(ws % nnodes == 0, f"world_size={ws} does not split evenly over launcher.nnodes={nnodes}")
    _require(0 <= cfg.launcher.node_rank < nnodes,
             f"launcher.node_rank={cfg.launcher.node_rank} must be in [0, {nnodes - 1}]")
    _require(nnodes == 1 or cfg.launcher.rdzv_endpoint or _scheduler_places_nodes(cfg),
             "launcher.nnodes > 1 needs launcher.rdzv_endpoint=HOST:PORT (the node_rank=0 machine), "
             "or hydra/launcher=slurm")
    _require(cfg.launcher.max_restarts >= 0, f"launcher.max_restarts must be >= 0, got {cfg.launcher.max_restarts}")
    _require(cfg.launcher.watchdog_s >= 0,
             f"launcher.watchdog_s must be >= 0 seconds (0 = off), got {cfg.launcher.watchdog_s}")
    _require(-1 <= cfg.fault.rank < ws,
             f"fault.rank={cfg.fault.rank} must be a rank in [0, {ws - 1}], or -1 for every rank")
    nodes = cfg.network.nodes if OmegaConf.select(cfg, "network.name") == "emulated" else nnodes
    _require(cfg.fault.node is None or 0 <= cfg.fault.node < nodes,
             f"fault.node={cfg.fault.node} must be a node in [0, {nodes - 1}] (network.nodes or launcher.nnodes)")
    _require(cfg.fault.slowdown > 1, f"fault.slowdown={cfg.fault.slowdown} must be > 1 (times as long)")
    _require(cfg.fault.step >= 0, f"fault.step must be a step >= 0, got {cfg.fault.step}")
    _require(cfg.backend.timeout_s > 0, f"backend.timeout_s must be > 0 seconds, got {cfg.backend.timeout_s}")
    _require(cfg.backend.collectives != "ring" or not _on_gpu(cfg),
             "backend.collectives=ring is the lab's rings for gloo; nccl runs its own (rings and trees already): "
             "use backend.collectives=auto or native")
    _validate_network(cfg)
    _validate_mesh(cfg)
    if cfg.backend.name == "nccl":
        from ddp_lab.machine import cuda_devices

        local_ranks, gpus = ws // nnodes, cuda_devices()
        _require(gpus >= local_ranks,
                 f"backend=nccl needs {local_ranks} CUDA GPUs on this node (one per rank), found {gpus}: "
                 "use backend=gloo or backend=auto")
    if cfg.task.name == "train":
        _validate_train(cfg)
    else:
        _validate_collective(cfg)


def _validate_network(cfg: DictConfig) -> None:
    """network=emulated: this machine can make namespaces and shape links, the ranks split over the nodes,
    and nothing else places nodes (launcher/emulated_network.py)."""
    net = cfg.network
    if net.name != "emulated":
        return
    _require(net.nodes >= 1, f"network.nodes must be >= 1, got {net.nodes}")
    _require(cfg.world_size % net.nodes == 0,
             f"world_size={cfg.world_size} does not split evenly over network.nodes={net.nodes}")
    _require(cfg.launcher.nnodes == 1 and not _scheduler_places_nodes(cfg),
             "network=emulated runs every node on this machine: use launcher.nnodes=1 (its nodes are "
             "network.nodes) and no SLURM launcher")
    _require(cfg.backend.name != "nccl", "network=emulated runs gloo between namespaces: use backend=gloo or auto")
    for key in ("gbps", "slow_gbps"):
        _require(net[key] is None or 0 < net[key] <= MAX_GBPS, f"network.{key} must be in (0, {MAX_GBPS:g}] Gbit/s "
                 f"(unset: unshaped), got {net[key]}")
    _require((net.slow_node is None) == (net.slow_gbps is None),
             "network.slow_node and network.slow_gbps go together: the node whose link is slower, and its rate")
    _require(net.slow_node is None or 0 <= net.slow_node < net.nodes,
             f"network.slow_node must be a node in [0, {net.nodes - 1}], got {net.slow_node}")
    if net.slow_step:
        _require(net.slow_node is not None, "network.slow_step needs network.slow_node and network.slow_gbps: the "
                 "link that turns slow at that step")
        _require(cfg.task.name == "train", "network.slow_step counts training steps: it needs task=train")
        _require(0 < net.slow_step < cfg.train.steps, f"network.slow_step must be a step of the run, in [1, "
                 f"{cfg.train.steps - 1}] (0: slow from the start), got {net.slow_step}")
        _require(net.latency_ms is None, "network.slow_step with network.latency_ms: changing a shaped link "
                 "would drop its delay qdisc; give one of the two")
    _require(net.latency_ms is None or net.latency_ms > 0,
             f"network.latency_ms must be > 0 ms (unset: none), got {net.latency_ms}")
    problem = emulation_problem()
    _require(problem is None, str(problem))
    if net.latency_ms is not None:
        missing = netem_problem()
        _require(missing is None, f"network.latency_ms={net.latency_ms}: {missing}; network.gbps alone shapes rate")


def _validate_mesh(cfg: DictConfig) -> None:
    """The mesh lays out (spec/parallel.py): tp x pp divides world_size (and tp the sequence, under sequence
    parallelism); what does not run on a mesh yet is refused, saying why."""
    p = cfg.parallel
    context = OmegaConf.select(cfg, "model.context_length", default=1)
    heads = OmegaConf.select(cfg, "model.num_heads", default=None)
    problem = (mesh_problem(cfg.world_size, p.tp, p.sequence_parallel, context, p.pp, p.cp)
               or context_problem(p.cp, str(p.cp_impl), p.cp_ulysses, context, heads, p.tp, p.sequence_parallel)
               or schedule_problem(p.pp, p.stages_per_rank, str(p.pp_schedule), microbatches_of(p), str(p.pp_impl)))
    _require(problem is None, str(problem))
    _validate_experts(cfg)
    if p.tp == 1 and p.pp == 1 and p.cp == 1:
        return
    keys = mesh_keys(p.tp, p.pp, p.cp)
    _require(cfg.task.name == "train", f"{keys} splits a model's layers: task={cfg.task.name} has no model (use "
             "parallel.tp=1 and parallel.pp=1)")


def _validate_experts(cfg: DictConfig) -> None:
    """A mixture's keys and `parallel.ep` (spec/experts.py), and what it is not proven with yet, refused saying so."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    ep = int(p.get("ep", 1))
    problem = moe_problem(m, ep, data_parallel_size(cfg) * int(p.cp))
    _require(problem is None, str(problem))
    if m.get("experts") is None:
        return
    name = m.get("name")
    _require(p.tp == 1, f"model={name} with parallel.tp={p.tp}: the experts are not split by tensor parallelism here "
             "(torchtitan keeps them whole too), and attention's split beside them is not proven: use parallel.tp=1")
    _require(p.pp == 1 or str(m.balance) != "aux_loss", f"model.balance=aux_loss with parallel.pp={p.pp}: the "
             "balancing loss of a stage's layers reaches only the last stage's loss: use model.balance=bias or none")
    if ep == 1:
        return
    if str(p.ep_impl) == "torch":
        _require(str(t.precision) != "fp16", "parallel.ep_impl=torch runs torch._grouped_mm, which takes fp32 and bf16 "
                 "only: use train.precision=fp32 or bf16, or parallel.ep_impl=lab")
        _require(m.d_model % 4 == 0 and m.expert_d_ff % 4 == 0, f"parallel.ep_impl=torch: torch._grouped_mm wants "
                 f"every row's bytes a multiple of 16: model.d_model={m.d_model} and model.expert_d_ff="
                 f"{m.expert_d_ff} must divide by 4")


def _validate_pipeline(cfg: DictConfig, small: torch.nn.Module) -> None:
    """The model runs as a chain (pp_layers()) of at least as many blocks as the pipeline has stages, and the
    schedule's constraints hold (spec/pipeline.py's pipeline_problem). `small`: the model at bounded depth; the
    blocks are counted on the model itself where that cut them."""
    from ddp_lab.models.facts import bounded_size

    p, t = cfg.parallel, cfg.train
    if p.pp == 1:
        _require(p.stage_layers is None, "parallel.stage_layers splits a pipeline's blocks, and parallel.pp=1 is none")
        return
    _require(hasattr(small, "pp_layers"), f"parallel.pp={p.pp}: model={cfg.model.name} does not say how its forward "
             "runs as a chain of layers (its class has no pp_layers(): docs/pipelines.md)")
    module = small if bounded_size(cfg.model) == cfg.model else _meta_model(cfg)
    blocks = len(module.pp_layers()[1])
    layers = p.stage_layers if p.stage_layers is None or isinstance(p.stage_layers, str) else list(p.stage_layers)
    problem = pipeline_problem(p.pp, p.stages_per_rank, str(p.pp_schedule), microbatches_of(p),
                               t.batch_size // data_parallel_size(cfg), blocks, layers, t.grad_accum_steps,
                               str(p.pp_impl))
    _require(problem is None, str(problem))


def _validate_context(cfg: DictConfig, module: torch.nn.Module) -> None:
    """The model takes context parallelism's attention and positions (its class has `context_parallel()`)."""
    cp = cfg.parallel.cp
    _require(cp == 1 or hasattr(module, "context_parallel"), f"parallel.cp={cp}: model={cfg.model.name} does not say "
             "how its attention exchanges a split sequence (its class has no context_parallel(attend, positions): "
             "docs/context.md)")


def _validate_tensor_parallel(cfg: DictConfig, module: torch.nn.Module) -> None:
    """The model declares a plan, and parallel.tp splits every layer of it into whole heads, rows and columns."""
    from ddp_lab.models.facts import tp_layers

    tp = cfg.parallel.tp
    if tp == 1:
        return
    plan, shapes, _ = tp_layers(module)
    problem = plan_problem(plan, shapes, tp)
    _require(problem is None, f"parallel.tp={tp} with model={cfg.model.name}: {problem}")
    _require(not cfg.parallel.sequence_parallel or getattr(module, "tp_sequence_parallel", True),
             f"parallel.sequence_parallel=true: model={cfg.model.name}'s tensor-parallel plan does not run on "
             "sequence shards (its class sets tp_sequence_parallel = False)")


@cache
def _schema() -> DictConfig:
    """The run's schema, built once a process (a sweep's or a test's many checks merge into it; merge copies it)."""
    return OmegaConf.structured(Config)


def _validate_keys(cfg: DictConfig) -> None:
    """Every key is one the schema has: Hydra refuses `train.stepz=3`, but lets `+train.stepz=3` add one."""
    try:
        plain = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), enum_to_str=True)
        OmegaConf.merge(_schema(), plain)
    except ConfigKeyError as exc:
        raise ConfigError(f"unknown key {exc.full_key}: ddp_lab/config.py has no such key (mistyped, or added "
                          "with '+'?)") from None


def _scheduler_places_nodes(cfg: DictConfig) -> bool:
    """Under a submitit launcher each node's job learns its node rank and endpoint from SLURM (cluster.py)."""
    return "submitit" in str(OmegaConf.select(cfg, "hydra.launcher._target_", default="") or "")


def _nodes(cfg: DictConfig) -> int:
    """The job's nodes: launcher.nnodes, or network.nodes on emulated nodes."""
    net = OmegaConf.select(cfg, "network")
    return net.nodes if net is not None and net.name == "emulated" else cfg.launcher.nnodes


def _on_gpu(cfg: DictConfig) -> bool:
    from ddp_lab.machine import resolve_backend

    return resolve_backend(cfg.backend.name, cfg.world_size // cfg.launcher.nnodes) == "nccl"


def _validate_train(cfg: DictConfig) -> None:
    t, m, ws = cfg.train, cfg.model, cfg.world_size
    _require(t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
    _require(0 <= t.warmup_steps < t.steps,
             f"train.warmup_steps={t.warmup_steps} must be in [0, train.steps) so some steps are measured")
    _require(t.batch_size >= 1, f"train.batch_size must be >= 1, got {t.batch_size}")
    dp = data_parallel_size(cfg)
    over = f"world_size={ws}" if dp == ws else f"the data-parallel ranks (world_size / (tp x pp x cp) = {dp})"
    _require(t.batch_size % dp == 0,
             f"train.batch_size={t.batch_size} (global) does not divide by {over}: use a multiple of {dp}")
    _require(t.grad_accum_steps >= 1, f"train.grad_accum_steps must be >= 1, got {t.grad_accum_steps}")
    local = t.batch_size // dp
    _require(local % t.grad_accum_steps == 0, f"each rank's batch ({local}) does not divide into "
             f"train.grad_accum_steps={t.grad_accum_steps} micro-batches")
    _require(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    _require(0 <= t.seed <= SEED_MAX - ws, f"train.seed must be in [0, {SEED_MAX - ws}] (rank r seeds numpy with "
             f"train.seed + r, and numpy takes seeds below 2^32), got {t.seed}")
    _require(t.weight_decay >= 0, f"train.weight_decay must be >= 0, got {t.weight_decay}")
    _require(not _takes_activations(cfg), f"model={m.get('name')} maps activations to activations (no token ids in, no "
             "logits out): a model for the calculator (python -m ddp_lab.calculator --model "
             f"{m.get('name')}), not for training")
    for key in ("context_length", "vocab_size"):  # every model takes them: the data is drawn from them
        _require(key in m, f"model={m.get('name')} has no {key}: every model takes vocab_size and context_length")
    for key in ("context_length", "vocab_size", "d_model", "d_ff", "num_layers", "num_heads"):
        _require(key not in m or not isinstance(m[key], int) or m[key] >= 1, f"model.{key} must be >= 1, got "
                 f"{m.get(key)}")
    _require(not {"d_model", "num_heads"} <= set(m) or m.d_model % m.num_heads == 0,
             f"model.d_model={m.get('d_model')} does not divide by model.num_heads={m.get('num_heads')}")
    _require("rope_theta" not in m or m.rope_theta > 0, f"model.rope_theta must be > 0, got {m.get('rope_theta')}")
    _validate_logits(cfg)
    spec, ranks_per_node = _strategy_spec(cfg.strategy), ws // _nodes(cfg)
    try:
        spec.check_mesh(int(cfg.parallel.tp), int(cfg.parallel.pp), str(cfg.parallel.pp_schedule),
                        int(cfg.parallel.cp))
        spec.check_world(dp * int(cfg.parallel.cp), ranks_per_node)
        spec.check_experts(int(cfg.parallel.ep))
        spec.check_run(str(t.precision), int(t.grad_accum_steps))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _require(cfg.network.name != "emulated" or spec.emulated_nodes, f"strategy={spec.name} runs on the host network "
             "only: its servers advertise this host's name, which another emulated node cannot reach")
    _require(str(t.optimizer) == "adamw" or spec.whole_parameter_optimizer,
             f"train.optimizer={t.optimizer} needs an optimizer over whole parameters, and strategy={spec.name}'s "
             "updates slices of them, or is its own (demo): use train.optimizer=adamw, or a strategy that keeps them "
             "whole")
    _validate_data(cfg)
    from ddp_lab.machine import precision_problem

    problem = precision_problem(t.precision, "cuda" if _on_gpu(cfg) else "cpu")
    _require(problem is None, f"train.precision={t.precision}: {problem}")
    _validate_comm_dtype(cfg, spec)
    p = cfg.parallel
    problem = checkpointing_problem(str(t.activation_checkpointing), p.pp, str(p.pp_schedule)) or \
        (compile_problem(p.tp, str(p.tp_impl), p.cp, str(p.cp_impl)) if t.compile else None)
    _require(problem is None, problem)
    _require(not t.compile or spec.compile_refusal is None,
             f"train.compile=true: strategy={spec.name} cannot run compiled here: {spec.compile_refusal}")
    _require(not t.compile or t.warmup_steps >= 1, "train.compile=true compiles in the first step: give it "
             "train.warmup_steps >= 1 so the compile time stays out of the step figures")
    _require(str(t.compile_backend) in COMPILE_BACKENDS, f"train.compile_backend must be one of "
             f"{', '.join(COMPILE_BACKENDS)}, got {t.compile_backend}")
    problem = grad_error_problem(p.pp, str(p.pp_schedule)) if cfg.measure.grad_error else None
    _require(problem is None, problem)
    _require(not (cfg.measure.grad_error and spec.zero_stage >= 3),
             f"measure.grad_error: strategy={spec.name} shards the parameters themselves (ZeRO-3), so the "
             "probe (rank/grad_error.py) cannot match its delivered gradient to the exact one: use another strategy")
    small = _meta_model(cfg, small=True)  # its kinds of layers, at a bounded size
    _validate_model_for_strategy(cfg, spec, small)
    _validate_tensor_parallel(cfg, small)
    _validate_pipeline(cfg, small)
    _validate_context(cfg, small)
    _validate_memory(cfg, spec.zero_stage, spec.shard_ranks(dp * cfg.parallel.cp, ranks_per_node))  # from shapes
    _validate_checkpoint(cfg, spec)


def _takes_activations(cfg: DictConfig) -> bool:
    """The model's node says it takes activations, not tokens (spec/models/: `takes_tokens`; a YAML naming a class
    of the user's, with no node of its own, takes tokens)."""
    return not getattr(OmegaConf.get_type(cfg.model), "takes_tokens", True)


def _validate_logits(cfg: DictConfig) -> None:
    """The first memory check, torch-free and so answered in a moment: every model maps a micro-batch of
    context_length tokens to logits over vocab_size, and the loss saves their log-softmax in fp32 for backward,
    so a rank needs at least 4 x micro-batch x context_length x vocab_size bytes whatever else its model saves.
    On CPU (where each rank shares this machine's memory) a job refused by that bound alone is refused before
    torch is imported; the full estimate (`_validate_memory`) follows for the rest."""
    m = cfg.model
    if _on_gpu(cfg):
        return
    from ddp_lab.machine import host_available_bytes
    from ddp_lab.units import fmt_bytes

    micro_batch = micro_batch_size(cfg)
    least = 4 * micro_batch * m.context_length * m.vocab_size
    ranks, have = cfg.world_size // cfg.launcher.nnodes, host_available_bytes()
    _require(least * ranks <= MEMORY_HEADROOM * have,
             f"model.context_length={m.context_length} with model.vocab_size={m.vocab_size} and {micro_batch} "
             f"sequences per rank: its logits alone need {fmt_bytes(least)} per rank ({fmt_bytes(least * ranks)} "
             f"in all), more than {int(MEMORY_HEADROOM * 100)}% of this machine's free memory ({fmt_bytes(have)}): "
             "use a shorter context, a smaller batch or fewer ranks")


def _validate_data(cfg: DictConfig) -> None:
    """The data source opens (every file read, its header checked, memory-mapped), both splits hold a
    sequence, and every token id is below the model's vocabulary (ddp_lab/data/)."""
    t, d = cfg.train, cfg.data
    _require(t.eval_every >= 0,
             f"train.eval_every must be >= 0 steps (0: after the last step only), got {t.eval_every}")
    _require(t.eval_batches >= 0, f"train.eval_batches must be >= 0 (0: no validation loss), got {t.eval_batches}")
    from ddp_lab.machine import host_available_bytes
    from ddp_lab.units import fmt_bytes

    held = 8 * t.eval_batches * max(1, t.batch_size // data_parallel_size(cfg)) * (cfg.model.context_length + 1)
    _require(held * cfg.world_size <= MEMORY_HEADROOM * host_available_bytes(),
             f"train.eval_batches={t.eval_batches}: each rank keeps its held-out batches in memory, "
             f"{fmt_bytes(held)} of token ids per rank, more than this machine has free: use fewer")
    if d.name == "synthetic":
        return
    _require(not OmegaConf.is_missing(d, "path"),
             f"data={d.name} needs data.path=FILE: a token file, a folder of shards, or a glob")
    _require(0 <= d.val_fraction < 1, f"data.val_fraction must be in [0, 1), got {d.val_fraction}")
    try:
        data = open_data(d, cfg.model.context_length)
        top = data.max_token()
    except DataError as exc:
        raise ConfigError(str(exc)) from None
    _require(top < cfg.model.vocab_size,
             f"data={d.name} has token ids up to {top}, but model.vocab_size={cfg.model.vocab_size}: set "
             f"model.vocab_size to at least {top + 1} (your tokenizer's vocabulary)")


def _strategy_spec(strategy: DictConfig) -> StrategySpec:
    """The strategy's spec: knobs typed, in range, and each one the strategy has (spec/strategies/)."""
    try:
        return spec_of(strategy)
    except SpecError as exc:
        raise ConfigError(str(exc)) from None


def _validate_comm_dtype(cfg: DictConfig, spec: StrategySpec) -> None:
    """comm_dtype means nothing without a gradient collective; and gradients through torch's comm hooks
    (torch_ddp, zero1_torch, zero1 with grad_sync=torch_ddp): torch's bf16_compress_hook wants CUDA 11+
    and NCCL 2.10+ (a name check in DDP's register_comm_hook, tests/parity/test_comm_dtype.py), so bf16
    on gloo would fail in every rank."""
    comm_dtype = spec.knobs().get("comm_dtype")
    _require(comm_dtype is None or spec.reduces_gradients, not_a_knob(type(spec), "comm_dtype"))
    _require(not (spec.torch_comm_hooks() and comm_dtype == "bf16" and not _on_gpu(cfg)),
             f"strategy.comm_dtype=bf16: strategy={spec.name} reduces through torch DDP's bf16_compress_hook, "
             "which torch allows only on CUDA with NCCL 2.10+, not on gloo: use comm_dtype=fp16, or a hand-written "
             "strategy (strategy=bucketed) for bf16 on the wire")


def _meta_model(cfg: DictConfig, small: bool = False) -> torch.nn.Module:
    """The model, built on the meta device: no memory, whatever its size. `small`: at most MEASURED_DEPTHS[-1]
    blocks and MEASURED_CONTEXTS[-1] tokens (models/facts.py), what its strategy's `check_model` asks of its
    kinds of layers, in bounded time (a meta build still costs a moment per block)."""
    from ddp_lab.models.facts import bounded_size, meta_model

    try:
        return meta_model(bounded_size(cfg.model) if small else cfg.model)
    except (TypeError, ValueError, RuntimeError, MemoryError, InstantiationException) as exc:
        raise ConfigError(f"model={cfg.model.name} cannot be built from its config: {first_line(exc)}") from None


def _validate_model_for_strategy(cfg: DictConfig, spec: StrategySpec, module: torch.nn.Module) -> None:
    """The spec's `check_model(module)` (fsdp: is there a unit to shard?) sees the model, built on the
    meta device."""
    try:
        spec.check_model(module)
    except ValueError as exc:
        raise ConfigError(f"strategy={spec.name} with model={cfg.model.name}: {exc}") from None


def _validate_checkpoint(cfg: DictConfig, spec: StrategySpec) -> None:
    c, t = cfg.checkpoint, cfg.train
    _require(c.every >= 0, f"checkpoint.every must be >= 0 steps (0 = never), got {c.every}")
    _require(c.keep >= 0, f"checkpoint.keep must be >= 0 checkpoints (0 = every one), got {c.keep}")
    if cfg.launcher.max_restarts and not c.every:
        raise ConfigError(f"launcher.max_restarts={cfg.launcher.max_restarts} restarts the workers from the job's "
                          "newest checkpoint, and checkpoint.every=0 writes none: set checkpoint.every")
    _require(not c.async_save or c.every, "checkpoint.async_save=true writes the checkpoints checkpoint.every asks "
             "for, and checkpoint.every=0 asks for none: set checkpoint.every")
    if not (c.every or c.load or cfg.launcher.max_restarts):
        return
    if c.every:
        try:
            spec.check_checkpoints()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if not c.load:
        return
    from ddp_lab.jobdir import (
        checkpoint_problem,
        leaves_measured_steps,
        newest_checkpoint,
        own_format_problem,
        read_checkpoint,
    )

    _require(Path(c.load).is_dir(), f"checkpoint.load={c.load}: no such folder")
    path = newest_checkpoint(c.load)
    _require(path is not None, f"checkpoint.load={c.load}: no complete checkpoint there (a step folder "
             "JOB/checkpoints/step_N, or a job folder that has one)")
    try:
        meta = read_checkpoint(path)
    except ValueError as exc:
        raise ConfigError(f"checkpoint.load={c.load}: {exc}") from None
    module = _meta_model(cfg)  # every parameter's name and shape, at the size asked for (its memory was checked)
    problem = checkpoint_problem(meta, {name: list(p.shape) for name, p in module.named_parameters()})
    _require(problem is None, f"checkpoint.load={path}: {problem}")
    problem = own_format_problem(meta, spec.name, spec.own_checkpoint, cfg.world_size)
    _require(problem is None, f"checkpoint.load={path}: {problem}")
    _require(leaves_measured_steps(meta, t),
             f"checkpoint.load={path} was taken after step {meta['step']}: train.steps={t.steps} leaves "
             f"{max(0, t.steps - meta['step'])} steps, not more than train.warmup_steps={t.warmup_steps}: raise "
             "train.steps")


def _validate_collective(cfg: DictConfig) -> None:
    """task=allreduce: the benchmark's knobs, and memory, so a 1 GiB message at 6 ranks that cannot
    fit is refused here instead of a rank being OOM-killed in the middle of a sweep."""
    t, ws = cfg.task, cfg.world_size
    _require(t.size_mb > 0, f"task.size_mb must be > 0 MiB, got {t.size_mb}")
    _require(t.size_mb * MiB >= 4 * ws,
             f"task.size_mb={t.size_mb} is less than one float32 per rank at world_size={ws}")
    _require(t.iters >= 1, f"task.iters must be >= 1, got {t.iters}")
    _require(0 <= t.warmup_iters <= t.iters, f"task.warmup_iters must be in [0, task.iters={t.iters}] (the time "
             f"budget caps the timed iterations, not the warm-up), got {t.warmup_iters}")
    _require(t.time_budget_s > 0, f"task.time_budget_s must be > 0 seconds, got {t.time_budget_s}")
    _require(not cfg.profile, "profile=true traces training steps: use it with task=train")
    import torch

    from ddp_lab.launcher.memory_estimate import fmt_bytes
    from ddp_lab.machine import host_available_bytes

    per_rank = bytes_per_rank(t.op, int(t.size_mb * MiB), ws)
    local_ranks = ws // cfg.launcher.nnodes
    if _on_gpu(cfg):
        need, have, where = per_rank, torch.cuda.get_device_properties(0).total_memory, "each GPU"
    else:
        # gloo's scratch space: peak RSS measured at 1.5-1.7x the buffers (torch 2.13), plus each
        # rank's interpreter and torch (~0.25 GiB).
        need = local_ranks * (GLOO_SCRATCH * per_rank + RANK_BASELINE_BYTES)
        have, where = host_available_bytes(), "this machine's free memory"
    _require(need <= MEMORY_HEADROOM * have,
             f"task.size_mb={t.size_mb} needs {fmt_bytes(per_rank)} of buffers per rank for {t.op}, about "
             f"{fmt_bytes(need)} for {local_ranks} ranks on this node, more than {int(MEMORY_HEADROOM * 100)}% "
             f"of {where} ({fmt_bytes(have)}): use a smaller task.size_mb or fewer ranks per node")


def _validate_memory(cfg: DictConfig, zero_stage: int, shard_ranks: int | None = None) -> None:
    """Refuse a model that cannot fit, instead of letting the kernel OOM-kill a rank mid-run."""
    import torch

    from ddp_lab.launcher.memory_estimate import estimate_rank_bytes, fmt_bytes
    from ddp_lab.machine import host_available_bytes

    local_ranks = cfg.world_size // cfg.launcher.nnodes
    if _on_gpu(cfg):
        ranks, have, where = 1, torch.cuda.get_device_properties(0).total_memory, "each GPU"
    else:
        ranks, have, where = local_ranks, host_available_bytes(), "this machine's free memory"
    try:
        state = estimate_rank_bytes(cfg, zero_stage, shard_ranks, activations=False)  # parameters alone first
        per_rank = state if state * ranks > MEMORY_HEADROOM * have else estimate_rank_bytes(cfg, zero_stage,
                                                                                              shard_ranks)
    except (TypeError, ValueError, RuntimeError, MemoryError, InstantiationException) as exc:
        raise ConfigError(f"model={cfg.model.name} cannot be built from its config: {first_line(exc)}") from None
    need = per_rank * ranks
    _require(need <= MEMORY_HEADROOM * have,
             f"model={cfg.model.name} needs about {fmt_bytes(per_rank)} per rank ({fmt_bytes(need)} in all), "
             f"more than {int(MEMORY_HEADROOM * 100)}% of {where} ({fmt_bytes(have)}): "
             "use a smaller model, fewer ranks per node, or a smaller batch/context")
