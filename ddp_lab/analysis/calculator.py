"""Memory and communication calculator for a model configuration: the assignment's accounting, as a tool.

    python -m ddp_lab.calculator model=small world_size=8 dtype=bf16 flops=989e12 bandwidth=450e9
    python -m ddp_lab.calculator --model xl --world-size 64 --json

Answers, per device: bytes of parameters, gradients and optimizer state (fp32 training, or
mixed-precision bf16 Adam at 16 bytes per parameter as in the ZeRO paper) with nothing sharded,
with ZeRO-1/2/3 sharding over N ranks; bytes each rank moves per step for each strategy; and the
per-device batch at which backward's compute takes as long as the gradient communication, i.e.
the batch above which a device is compute-bound rather than communication-bound.

Parameters are counted analytically from the architecture in ddp_lab/models (the tests check the
count against the built model for every conf/model size), so the calculator needs no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ddp_lab.spec.zero_bytes import DTYPE_BYTES, comm_bytes_per_step, model_state_bytes

MODEL_DIR = Path(__file__).resolve().parents[2] / "conf" / "model"

STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def load_model_config(name: str, overrides: dict | None = None) -> DictConfig:
    """conf/model/NAME.yaml (no Hydra composition needed), with `overrides` merged on top."""
    path = MODEL_DIR / f"{name}.yaml"
    if not path.exists():
        options = ", ".join(sorted(p.stem for p in MODEL_DIR.glob("*.yaml")))
        raise ValueError(f"unknown model {name!r}; options: {options}")
    cfg = OmegaConf.load(path)
    return OmegaConf.merge(cfg, overrides or {})


def _is_transformer(cfg) -> bool:
    return str(cfg._target_).endswith("Transformer")


def count_parameters(cfg) -> dict:
    """Parameters by part, exactly as ddp_lab/models builds them.

    Transformer: embedding V*d; per block RMSNorm d twice, qkv 3d^2 and output d^2 (no biases),
    SwiGLU w1, w3, w2 3*d*d_ff; final RMSNorm d; untied lm_head V*d.
    Total = 2Vd + L(4d^2 + 3 d d_ff + 2d) + d.
    ToyMLP: embedding V*d; per layer Linear(d, d_ff) and Linear(d_ff, d) with biases; untied
    output V*d without bias. Total = 2Vd + L(2 d d_ff + d_ff + d).
    `matmul` counts the weights used in matrix multiplies (all but the embedding lookup, norms
    and biases): 2 FLOPs per matmul weight per token forward.
    """
    V, d, f, L = cfg.vocab_size, cfg.d_model, cfg.d_ff, cfg.num_layers
    if _is_transformer(cfg):
        parts = {"embedding": V * d, "attention": L * 4 * d * d, "ffn": L * 3 * d * f,
                 "norms": (2 * L + 1) * d, "lm_head": V * d}
        parts["matmul"] = parts["attention"] + parts["ffn"] + parts["lm_head"]
    else:
        parts = {"embedding": V * d, "ffn": L * (2 * d * f + f + d), "lm_head": V * d}
        parts["matmul"] = L * 2 * d * f + V * d
    parts["total"] = sum(v for k, v in parts.items() if k != "matmul")
    return parts


def flops_per_token(cfg) -> dict:
    """Training FLOPs per token: forward 2 per matmul weight + attention scores; backward 2x forward.

    Attention's QK^T and AV add 2 * 2 * context * d per layer per token forward (the full
    square, as a non-flash kernel computes it; causal masking could halve it).
    """
    attention = 4 * cfg.num_layers * cfg.context_length * cfg.d_model if _is_transformer(cfg) else 0
    forward = 2 * count_parameters(cfg)["matmul"] + attention
    return {"forward": forward, "backward": 2 * forward, "step": 3 * forward}


def compute_bound_batch(cfg, comm_bytes: float, flops: float, bandwidth: float, overlap: str = "backward") -> float:
    """Sequences per device at which compute time equals communication time.

    Compute time for B sequences: B * context * flops_per_token / flops; communication: comm_bytes
    / bandwidth (bandwidth = achievable bus bandwidth per device). Above this batch the device is
    compute-bound (communication can hide behind compute); below it, communication-bound.
    overlap="backward" (default) compares with backward only, which is all DDP's gradient
    all-reduce can overlap with; "step" with forward + backward.
    Asymptotically for ddp in bf16: tokens = 4P*(N-1)/N * flops / (bandwidth * 4P) ~ flops / bandwidth.
    """
    per_token = flops_per_token(cfg)[overlap]
    comm_s = comm_bytes / bandwidth
    return comm_s * flops / (per_token * cfg.context_length)


def calculate(cfg, world_size: int = 8, dtype: str = "bf16", flops: float = 989e12,
              bandwidth: float = 450e9) -> dict:
    """Everything the CLI prints, as a dict (bytes, FLOPs, sequences)."""
    params = count_parameters(cfg)
    n = params["total"]
    fpt = flops_per_token(cfg)
    rows = {}
    for strategy in ("ddp", "zero1", "zero1_cs336", "zero2", "zero3"):
        stage = STAGES.get(strategy, 1)
        comm = comm_bytes_per_step(n, dtype, world_size, strategy)
        rows[strategy] = {
            "memory": model_state_bytes(n, dtype, world_size, stage),
            "comm_bytes": comm,
            "comm_s": comm / bandwidth,
            "compute_bound_batch": compute_bound_batch(cfg, comm, flops, bandwidth, "backward"),
            "compute_bound_batch_step": compute_bound_batch(cfg, comm, flops, bandwidth, "step"),
        }
    return {"model": cfg.get("name", "?"), "params": params, "dtype": dtype, "world_size": world_size,
            "flops": flops, "bandwidth": bandwidth, "context_length": cfg.context_length,
            "flops_per_token": fpt, "bytes_per_param": sum(DTYPE_BYTES[dtype]), "strategies": rows}


def _gb(x: float) -> str:
    return f"{x / 1e9:9.3f}"


def format_report(r: dict) -> str:
    p = r["params"]
    lines = [
        f"model {r['model']}: {p['total']:,} parameters ("
        + ", ".join(f"{k} {v:,}" for k, v in p.items() if k not in ("total", "matmul")) + ")",
        f"dtype {r['dtype']} ({r['bytes_per_param']} bytes/param with Adam: "
        + "/".join(str(b) for b in DTYPE_BYTES[r['dtype']]) + " params/grads/optimizer), "
        f"world_size {r['world_size']}, context {r['context_length']}, "
        f"{r['flops'] / 1e12:g} TFLOP/s, {r['bandwidth'] / 1e9:g} GB/s bus bandwidth per device",
        f"training FLOPs/token: forward {r['flops_per_token']['forward']:.3e}, "
        f"backward {r['flops_per_token']['backward']:.3e}",
        "",
        f"{'strategy':<12} {'params GB':>9} {'grads GB':>9} {'optim GB':>9} {'total GB':>9} "
        f"{'comm GB':>9} {'comm ms':>9} {'bound@bwd':>10} {'bound@step':>10}",
    ]
    for name, row in r["strategies"].items():
        m = row["memory"]
        lines.append(f"{name:<12} {_gb(m['params'])} {_gb(m['grads'])} {_gb(m['optimizer'])} {_gb(m['total'])} "
                     f"{_gb(row['comm_bytes'])} {row['comm_s'] * 1e3:9.3f} "
                     f"{row['compute_bound_batch']:10.2f} {row['compute_bound_batch_step']:10.2f}")
    lines += ["", "memory: model state per device (no activations); GB = 1e9 bytes. comm: bytes over each "
              "rank's link per step (nccl-tests bus convention).",
              "bound@bwd / bound@step: sequences per device above which backward (or the whole step) "
              "takes longer than the communication, i.e. the device is compute-bound."]
    return "\n".join(lines)


def _normalize_argv(argv: list[str]) -> list[str]:
    """Accept Hydra-style key=value (model=small world_size=8 model.context_length=512) as well as --flags."""
    out = []
    for tok in argv:
        if tok.startswith("-") or "=" not in tok:
            out.append(tok)
        elif tok.startswith("model."):
            out.append(f"--set={tok[len('model.'):]}")
        else:
            key, value = tok.split("=", 1)
            out += [f"--{key.replace('_', '-')}", value]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_lab.calculator", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="a conf/model name (toy, tiny, small, ... 2.7b)")
    parser.add_argument("--world-size", "--world_size", type=int, default=8, help="ranks (sharding degree N)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16",
                        help="bf16 = mixed precision Adam (16 bytes/param), fp32 = everything fp32")
    parser.add_argument("--flops", type=float, default=989e12, help="FLOP/s per device (default: H100 bf16 dense)")
    parser.add_argument("--bandwidth", type=float, default=450e9,
                        help="bus bandwidth per device, bytes/s (default: H100 NVLink, 450 GB/s one way)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a model key, e.g. context_length=512 (or model.context_length=512)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(_normalize_argv(sys.argv[1:] if argv is None else argv))
    if args.world_size < 1:
        parser.error("world size must be >= 1")
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = int(value) if value.lstrip("-").isdigit() else value
    try:
        cfg = load_model_config(args.model, overrides)
    except ValueError as exc:
        parser.error(str(exc))
    report = calculate(cfg, args.world_size, args.dtype, args.flops, args.bandwidth)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
