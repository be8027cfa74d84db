"""Names of runs and table rows, derived from a run's config alone (no torch, no process group)."""

from __future__ import annotations

from ddp_lab.spec.strategies import SpecError, spec_of
from ddp_lab.spec.strategy import NOT_KNOBS


def flatten(d, sep: str = "/", prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a/b': 1}: nested config or summary keys as one level (W&B summary keys and table
    columns with "/", dotted config keys with ".")."""
    out = {}
    for key, value in (d or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, sep, name + sep))
        else:
            out[name] = value
    return out


def knob_label(strategy_cfg) -> str:
    """`bucketed-bucket_mb=25.0`: a strategy config's name and the knobs it uses, for run names. A config
    whose spec cannot be had (a strategy from a package not installed here) shows the knobs it sets."""
    try:
        knobs = spec_of(strategy_cfg).used_knobs()
    except SpecError:
        knobs = {k: v for k, v in strategy_cfg.items() if k not in NOT_KNOBS and v is not None}
    return "-".join([str(strategy_cfg["name"])] + [f"{k}={v}" for k, v in knobs.items()])


def precision_label(cfg) -> str:
    """`-precision=bf16` when train.precision is not fp32 (the default), else nothing."""
    train = cfg.get("train") if hasattr(cfg, "get") else None
    precision = str((train or {}).get("precision") or "fp32")
    return "" if precision == "fp32" else f"-precision={precision}"


def compile_label(cfg) -> str:
    """`-compile=inductor` when the run was compiled (train.compile, its backend named), else nothing."""
    train = (cfg.get("train") if hasattr(cfg, "get") else None) or {}
    return f"-compile={train.get('compile_backend') or 'inductor'}" if train.get("compile") else ""


def data_label(cfg) -> str:
    """`-data=text`, `-data=text(corpus.txt)`, `-data=tokens(train.bin)`: the data when it is not the
    default synthetic sequences, else nothing."""
    data = cfg.get("data") if hasattr(cfg, "get") else None
    name = str((data or {}).get("name") or "synthetic")
    if name == "synthetic":
        return ""
    path = (data or {}).get("path")
    return f"-data={name}" + (f"({str(path).rstrip('/').rsplit('/', 1)[-1]})" if path else "")


def figures_label(cfg) -> str:
    """`-per_collective=off` when the run's collectives were counted but not stamped (measure.per_collective=false:
    for torch_ddp, torch's DDP bare), else nothing."""
    measure = (cfg.get("measure") if hasattr(cfg, "get") else None) or {}
    return "-per_collective=off" if measure.get("per_collective", True) is False else ""


def collectives_label(cfg) -> str:
    """`-collectives=native` when a gloo run asked for the backend's own reduce-scatter, all-gather and broadcast
    instead of the lab's rings (the default there), else nothing."""
    backend = (cfg.get("backend") if hasattr(cfg, "get") else None) or {}
    native = str(backend.get("collectives") or "auto") == "native" and str(backend.get("name")) != "nccl"
    return "-collectives=native" if native else ""


def mesh_label(cfg) -> str:
    """`-tp=2`, `-tp=2-sp-tp_impl=torch-tp_inner=false`, `-pp=2-1f1b-m=4`,
    `-pp=2-interleaved_1f1b-v=2-m=4-pp_impl=torch`, `-cp=4-zigzag`, `-cp=4-hybrid-u=2`: the axes beyond data
    parallelism where a run has them (parallel.tp > 1, parallel.pp > 1, parallel.cp > 1), else nothing."""
    from ddp_lab.spec.pipeline import microbatches_of

    parallel = (cfg.get("parallel") if hasattr(cfg, "get") else None) or {}
    tp, pp = int(parallel.get("tp", 1) or 1), int(parallel.get("pp", 1) or 1)
    label = ""
    if tp > 1:
        label += (f"-tp={tp}" + ("-sp" if parallel.get("sequence_parallel") else "")
                  + (f"-tp_impl={parallel.get('tp_impl')}" if str(parallel.get("tp_impl", "lab")) != "lab" else "")
                  + ("-tp_inner=false" if parallel.get("tp_inner", True) is False else ""))
    if pp > 1:
        chunks = int(parallel.get("stages_per_rank", 1) or 1)
        label += (f"-pp={pp}-{parallel.get('pp_schedule', '1f1b')}" + (f"-v={chunks}" if chunks > 1 else "")
                  + f"-m={microbatches_of(parallel)}"
                  + (f"-pp_impl={parallel.get('pp_impl')}" if str(parallel.get("pp_impl", "lab")) != "lab" else ""))
    cp = int(parallel.get("cp", 1) or 1)
    if cp > 1:
        impl = str(parallel.get("cp_impl", "ring"))
        label += f"-cp={cp}-{impl}" + (f"-u={parallel.get('cp_ulysses')}" if impl == "hybrid" else "")
    ep = int(parallel.get("ep", 1) or 1)
    if ep > 1:
        label += f"-ep={ep}" + (f"-ep_impl={parallel.get('ep_impl')}" if str(parallel.get("ep_impl", "lab")) != "lab"
                                else "")
    return label


def mixture_label(cfg) -> str:
    """`-balance=bias`, `-bias_rate=0.01`, `-coeff=0.1`, `-cf=1.25`, `-sigmoid`: what a mixture of experts' run changed
    from tiny_moe's defaults (softmax router, aux-loss balancing at 0.01, a bias rate of 0.001, dropless), else nothing;
    nothing for a dense model."""
    model = (cfg.get("model") if hasattr(cfg, "get") else None) or {}
    if model.get("experts") is None:
        return ""
    balance, capacity, router = model.get("balance", "aux_loss"), model.get("capacity_factor"), model.get("router")
    coeff, rate = model.get("balance_coeff", 0.01), model.get("bias_rate", 1e-3)
    return ((f"-{router}" if router not in (None, "softmax") else "")
            + (f"-balance={balance}" if balance != "aux_loss" else "")
            + (f"-coeff={coeff:g}" if balance == "aux_loss" and coeff != 0.01 else "")
            + (f"-bias_rate={rate:g}" if balance == "bias" and rate != 1e-3 else "")
            + (f"-cf={capacity:g}" if capacity is not None else ""))


def collective_label(task) -> str:
    """`all_reduce`, or `all_reduce back-to-back` when the calls were timed without a barrier between
    them (task.barrier=false): a different measurement of the same op, kept apart in tables and fits."""
    back_to_back = task.get("barrier", True) is False
    return f"{task.get('op')}{' back-to-back' if back_to_back else ''}"


def run_name(cfg) -> str:
    """`bucketed-bucket_mb=25-tiny-ws2` (`...-precision=bf16-data=text-tiny-ws2`): what the run measured,
    readable in a W&B table."""
    if cfg["task"]["name"] == "allreduce":
        task = cfg["task"]
        op = collective_label(task).replace(" ", "-")
        return f"{op}-{task['size_mb']}MiB-{cfg['backend']['name']}{collectives_label(cfg)}-ws{cfg['world_size']}"
    return (f"{knob_label(cfg['strategy'])}{mesh_label(cfg)}{mixture_label(cfg)}{compile_label(cfg)}"
            f"{precision_label(cfg)}{data_label(cfg)}{collectives_label(cfg)}{figures_label(cfg)}-{cfg['model']['name']}-ws{cfg['world_size']}")


def row_label(results: dict) -> str:
    """A table row's label: the strategy and its knobs, or the collective and its size."""
    cfg = results.get("config") or {}
    task = cfg.get("task") or {}
    if task.get("name") == "allreduce":
        return f"{collective_label(task)} {task.get('size_mb')} MiB{collectives_label(cfg)}"
    strategy = cfg.get("strategy")
    return (knob_label(strategy) + mesh_label(cfg) + mixture_label(cfg) + compile_label(cfg) + precision_label(cfg)
            + data_label(cfg)
            + collectives_label(cfg) + figures_label(cfg) if strategy else "?")
