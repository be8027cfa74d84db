"""The calculator on a mesh (`--tp`): memory and bytes per device by axis, and the per-device batch at which each
axis's communication hides under compute, every figure beside its formula.

    python -m ddp_lab.calculator --model xxl_ffn --world-size 64 --tp 4 --strategy fsdp --dtype fp32 --wire bf16 \\
        --flops 4.6e14 --bandwidth dp=3.6e11,tp=1.8e11 --phase forward --device-gb 80,95

The model's facts are counted from the model itself on the meta device (models/facts.py): parameters, FLOPs per
token, the activations autograd saves, its tensor-parallel plan. A step of N = dp x tp devices on a global
batch of B tokens:

- compute: each device computes 1/tp of the model's FLOPs for its data-parallel shard's B/dp tokens, so
  T_math = B · F / (N · C) for F FLOPs per token of the phase (forward, backward or the step) and C FLOP/s;
- the dp axis: the strategy's collectives of the phase (its declared schedule, spec/schedule.py) on this
  rank's TP pieces of the parameters, bytes_dp per device (nccl-tests' bus convention: an all-gather or
  reduce-scatter moves (n-1)/n of its tensor over each link, an all-reduce 2(n-1)/n); T_dp = bytes_dp / W_dp,
  whatever the batch. Compute-bound when T_math >= T_dp: B / N >= bytes_dp · C / (W_dp · F) tokens per device;
- the tp axis: tensor parallelism's collectives of the phase (spec/parallel.py's schedule), b_tok bytes per
  token of the device's data shard; T_tp = (B / dp) · b_tok / W_tp grows with the batch as T_math does, so
  the batch cancels: compute-bound at every batch when F / (tp · C) >= b_tok / W_tp, at none otherwise.

The TPU Scaling Book (part 5, the course's source) counts a collective as moving its whole tensor, without the
ring's (n-1)/n: its thresholds are printed beside ours, and on a small axis they differ (tp = 4: 4/3 of ours).
"""

from __future__ import annotations

import math

from ddp_lab.arithmetic.zero_bytes import DTYPE_BYTES, model_state_bytes
from ddp_lab.models.facts import activation_bytes, flops_per_token, meta_model, parameter_counts, tp_layers
from ddp_lab.spec.parallel import padded_vocab, tp_schedule
from ddp_lab.spec.strategy import StrategySpec

PHASES = ("forward", "backward", "step")
BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
       "reduce_scatter": lambda n: (n - 1) / n}
TP_PHASES = {"forward": ("forward", "cross_entropy"), "backward": ("backward",),
             "step": ("forward", "cross_entropy", "backward")}


def parse_bandwidth(text: str) -> dict[str, float]:
    """`3.6e11` (every axis) or `dp=3.6e11,tp=1.8e11` (bytes/s per device on each axis); ValueError otherwise."""
    if "=" not in text:
        value = float(text)
        return {"dp": value, "tp": value}
    out = {}
    for item in text.split(","):
        axis, sep, value = item.partition("=")
        if axis not in ("dp", "tp") or not sep:
            raise ValueError(f"--bandwidth takes one value or dp=...,tp=..., got {item!r}")
        out[axis] = float(value)
    if set(out) != {"dp", "tp"}:
        raise ValueError(f"--bandwidth per axis needs both dp= and tp=, got {text!r}")
    return out


def held_parameters(model_cfg, tp: int) -> int:
    """Parameters one TP rank holds: the plan's split weights at 1/tp (the lab's vocabulary padded), the rest
    whole; the whole model at tp = 1."""
    total = parameter_counts(model_cfg)["total"]
    if tp == 1:
        return total
    module = meta_model(model_cfg)
    plan, shapes, _ = tp_layers(module)
    held = total
    for name, shape in shapes.items():
        style = type(plan[name]).__name__
        if style in ("VocabEmbedding", "VocabHead"):
            held -= math.prod(shape) - padded_vocab(shape[0], tp) // tp * math.prod(shape[1:])
        elif style in ("Colwise", "Rowwise"):
            layer = module.get_submodule(name)
            bias = layer.bias.numel() if getattr(layer, "bias", None) is not None and style == "Colwise" else 0
            held -= (math.prod(shape) + bias) - (math.prod(shape) + bias) // tp
    return held


def tp_bytes_per_token(model_cfg, tp: int, sequence_parallel: bool, wire: int, phase: str) -> tuple[float, float]:
    """(bytes per token of a device's data shard, bytes per step whatever the batch) over each link of the tp axis
    in `phase`, in the bus convention: the schedule at 0 and 1 token apart."""
    if tp == 1:
        return 0.0, 0.0
    plan, shapes, partial = tp_layers(meta_model(model_cfg))

    def total(tokens: int) -> float:
        return sum(BUS[c.op](tp) * c.nbytes for c in tp_schedule(plan, shapes, tp, sequence_parallel, tokens, wire,
                                                                  partial) if c.phase in TP_PHASES[phase])
    fixed = total(0)
    return total(1) - fixed, fixed


def mesh_accounting(model_cfg, world_size: int, tp: int, spec: StrategySpec, dtype: str = "fp32",
                    wire: str = "bf16", flops: float = 989e12, bandwidth: dict | None = None, phase: str = "forward",
                    sequence_parallel: bool = False, device_gb: tuple[float, ...] = (80.0,),
                    tokens_per_device: float = 0.0) -> dict:
    """Every figure of the mesh report as a dict (module docstring): bytes, seconds, tokens."""
    if world_size % tp:
        raise ValueError(f"--tp {tp} does not divide --world-size {world_size}")
    if phase not in PHASES:
        raise ValueError(f"--phase must be one of {', '.join(PHASES)}, got {phase!r}")
    bandwidth = bandwidth or {"dp": 450e9, "tp": 450e9}
    dp, wire_bytes = world_size // tp, DTYPE_BYTES[wire][1]
    params = parameter_counts(model_cfg)
    n, held = params["total"], held_parameters(model_cfg, tp)
    per_token = flops_per_token(model_cfg)[phase]
    state = model_state_bytes(held, dtype, dp, spec.zero_stage)
    whole = model_state_bytes(n, dtype, 1, 0)["total"]
    activations = activation_bytes(model_cfg, 1) / model_cfg.context_length * wire_bytes / 4  # per token, in wire
    schedule = spec.schedule()
    phases = schedule.phase_bytes(wire_bytes * held, wire_bytes * held, dp) if schedule is not None else None
    dp_bytes = None if phases is None else (sum(phases.values()) if phase == "step" else phases[phase])
    tp_token, tp_fixed = tp_bytes_per_token(model_cfg, tp, sequence_parallel, wire_bytes, phase)
    out = {"model": model_cfg.get("name", "?"), "params": params, "held_params": held, "world_size": world_size,
           "dp": dp, "tp": tp, "strategy": spec.name, "zero_stage": spec.zero_stage, "dtype": dtype, "wire": wire,
           "flops": flops, "bandwidth": bandwidth, "phase": phase, "flops_per_token": per_token,
           "memory": {"state_whole_model": whole, "bytes_per_param": sum(DTYPE_BYTES[dtype]),
                      "devices_for_state": {gb: whole / (gb * 1e9) for gb in device_gb},
                      "activations_per_token": activations, "state_per_device": state,
                      "fsdp_devices_to_fit": {gb: fsdp_devices(n, dtype, activations * tokens_per_device, gb * 1e9)
                                              for gb in device_gb},
                      "tokens_per_device": tokens_per_device},
           "dp_axis": {"bytes": dp_bytes, "seconds": None if dp_bytes is None else dp_bytes / bandwidth["dp"],
                       "phases": phases},
           "tp_axis": {"bytes_per_token": tp_token, "fixed_bytes": tp_fixed}}
    math_per_token_device = per_token / (world_size * flops)  # T_math per token of the global batch, per device
    if dp_bytes:
        per_device = dp_bytes * flops / (bandwidth["dp"] * per_token)
        book = dp_bytes / ((dp - 1) / dp if dp > 1 else 1) * flops / (bandwidth["dp"] * per_token)
        out["dp_axis"].update(tokens_per_device=per_device, tokens_overall=per_device * world_size,
                              book_tokens_per_device=book, book_tokens_overall=book * world_size)
    if tp > 1:
        compute = per_token / (tp * flops)  # seconds per token of the shard, on one device
        comm = tp_token / bandwidth["tp"]
        book = comm * tp / (tp - 1)  # the Scaling Book's count: no (n-1)/n
        out["tp_axis"].update(compute_s_per_token=compute, comm_s_per_token=comm, ratio=compute / comm,
                              book_ratio=compute / book, compute_bound=compute >= comm,
                              book_compute_bound=compute >= book)
    out["math_s_per_token"] = math_per_token_device
    out["binding"] = binding_axis(out)
    return out


def fsdp_devices(n_params: int, dtype: str, activations: float, device_bytes: float) -> int | None:
    """The smallest N at which N-way FSDP fits a device: the model state sharded N ways and half the activations
    (every second layer's) too, the other half whole: (S + A/2) / N + A/2 <= M, S the state. None: never."""
    whole = sum(DTYPE_BYTES[dtype]) * n_params
    room = device_bytes - activations / 2
    return None if room <= 0 else max(1, math.ceil((whole + activations / 2) / room))


def binding_axis(r: dict) -> str:
    """Which axis keeps a device from being compute-bound, and from what batch."""
    tp = r["tp_axis"]
    if r["tp"] > 1 and not tp["compute_bound"]:
        return "tp: its communication outgrows compute at any batch (the batch cancels out)"
    if r["dp_axis"].get("tokens_per_device") is not None:
        return f"dp: compute-bound from {r['dp_axis']['tokens_per_device']:.1f} tokens per device"
    return "none: no communication in this phase"


def format_mesh_report(r: dict) -> str:
    p, m, d, t = r["params"], r["memory"], r["dp_axis"], r["tp_axis"]
    dp, tp, n = r["dp"], r["tp"], r["world_size"]
    lines = [
        f"model {r['model']}: {p['total']:,} parameters ({p['matmul']:,} in matmul weights); {r['phase']} "
        f"{r['flops_per_token']:.4g} FLOP/token (F)",
        f"mesh: world_size {n} = dp {dp} x tp {tp}; strategy {r['strategy']} (ZeRO-{r['zero_stage']}) on the dp "
        f"axis; C = {r['flops']:.4g} FLOP/s; W_dp = {r['bandwidth']['dp']:.4g}, W_tp = {r['bandwidth']['tp']:.4g} "
        "bytes/s per device",
        "",
        f"memory: state in {r['dtype']} ({m['bytes_per_param']} B/param: "
        + " + ".join(str(b) for b in DTYPE_BYTES[r['dtype']]) + " weights, gradients, Adam), activations in "
        f"{r['wire']}",
        f"  whole model's state: {m['bytes_per_param']} x P = {m['state_whole_model'] / 1e9:,.1f} GB"
        + "".join(f"; {count:.2f} devices of {gb:g} GB" for gb, count in m["devices_for_state"].items()),
        f"  activations saved for backward: A = {m['activations_per_token'] / 1e6:.4g} MB per token",
        f"  N-way FSDP, state and half the activations sharded: (S + A/2) / N + A/2 per device, with "
        f"{m['tokens_per_device']:g} tokens per device: smallest N "
        + ", ".join(f"{v if v is not None else 'none'} for {gb:g} GB" for gb, v in m["fsdp_devices_to_fit"].items()),
        f"  on this mesh, per device: {r['held_params']:,} parameters held (1/tp of the split ones), state "
        f"{m['state_per_device']['total'] / 1e9:,.2f} GB (params {m['state_per_device']['params'] / 1e9:.2f}, grads "
        f"{m['state_per_device']['grads'] / 1e9:.2f}, optimizer {m['state_per_device']['optimizer'] / 1e9:.2f})",
        "",
        f"communication per device in {r['phase']} (bus convention: (n-1)/n of an all-gather's or reduce-scatter's "
        "tensor over each link, 2(n-1)/n of an all-reduce's)",
    ]
    if d["bytes"] is None:
        lines.append("  dp: the strategy declares no schedule")
    else:
        lines.append(f"  dp: {d['bytes'] / 1e9:.4g} GB -> T_dp = {d['seconds']:.4g} s, whatever the batch")
    if tp > 1:
        lines.append(f"  tp: b_tok = {t['bytes_per_token'] / 1e6:.4g} MB per token of the device's data shard"
                     + (f", + {t['fixed_bytes'] / 1e6:.4g} MB per step" if t["fixed_bytes"] else ""))
    lines += ["", f"compute-bound ({r['phase']}): T_math = B F / (N C) >= each axis's communication"]
    if d.get("tokens_per_device") is not None:
        lines.append(f"  dp: B/N >= bytes_dp C / (W_dp F) = {d['tokens_per_device']:.1f} tokens per device, "
                     f"B >= {d['tokens_overall']:,.0f} overall (the Scaling Book, without (n-1)/n: "
                     f"{d['book_tokens_per_device']:.1f} per device, {d['book_tokens_overall']:,.0f} overall)")
    if tp > 1:
        verdict = "at every batch" if t["compute_bound"] else "at no batch"
        book = "at every batch" if t["book_compute_bound"] else "at no batch"
        lines.append(f"  tp: F / (tp C) >= b_tok / W_tp, the batch cancels: {t['compute_s_per_token'] * 1e6:.4g} vs "
                     f"{t['comm_s_per_token'] * 1e6:.4g} us per token, ratio {t['ratio']:.3f}: compute-bound {verdict} "
                     f"(the Scaling Book: ratio {t['book_ratio']:.3f}, {book})")
    lines.append(f"  binding axis: {r['binding']}")
    return "\n".join(lines)
