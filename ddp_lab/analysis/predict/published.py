"""`predict published`: ddp-lab's predictions against measurements others published on real GPUs.

Each source is a file in published/ with its citation (repository, path, commit) and the rows as
published. Systems come from spec sheets and NCCL's constants (systems.py), never from these
tables; where a figure of a table is used as an input (the compute time of a model, measured on one
GPU or at the smallest scale), that row is the calibration and is not scored. Every prediction is
printed beside torch's own estimator (torch_estimate.py) in the same replay.

- nccl: NVIDIA's DGX H100 `all_reduce_perf` sweep, 8 B to 16 GiB: one collective, no calibration.
- ddp: torch's DDP benchmark on DGX-1 V100s (ResNet-50/101, ResNeXt-50/101, 1 to 16 GPUs, 25 MiB
  buckets): the models described by their parameters in order (resnet_parameters, counted as
  torchvision builds them) and the 1-GPU "no ddp" p50 as compute (forward a third, backward two
  thirds, gradients ready by each layer's backward FLOPs); DDP replayed on ddp-lab's NCCL model;
  and the 1 MiB-bucket slowdown its diff table reports.
- torchtitan: Llama 3.1 8B with FSDP2 from 8 to 128 H100s: compute set so the 8-GPU step is the
  measured one, the 128-GPU step predicted; scored on the step's growth.
- torchtitan_multi_axis: Llama 3.1 8B, 70B and 405B with FSDP, TP, PP and CP together on up to 512 H100s, priced by
  the planner (ddp_lab/analysis/plan/price.py) at the MFU that makes its price of the published 1D row (Table 1,
  the same software: torch.compile and Float8) the measured one; each row's tokens per second per GPU and memory
  beside the published, and where the planner, given the row's model, GPUs and batch, ranks the published layout.
"""

from __future__ import annotations

import json
from pathlib import Path

from ddp_lab.analysis.predict import nccl, torch_estimate
from ddp_lab.analysis.predict.costs import PredictError
from ddp_lab.analysis.predict.scale import described_workload, step_ms
from ddp_lab.analysis.predict.systems import SYSTEMS

HERE = Path(__file__).parent / "published"
SOURCES = {"nccl": "nccl_dgx_h100_all_reduce.json", "ddp": "ddp_v100_resnet.json",
           "torchtitan": "torchtitan_llama3_8b_h100.json",
           "torchtitan_multi_axis": "torchtitan_llama3_multi_axis_h100.json"}


def load(source: str) -> dict:
    if source not in SOURCES:
        raise PredictError(f"unknown published source {source!r}; options: {', '.join(SOURCES)}")
    return json.loads((HERE / SOURCES[source]).read_text())


def cite(data: dict) -> str:
    s = data["source"]
    return f"{s['repository']} {s['path']} at {s['commit'][:7]}"


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas


# --- NVIDIA's all-reduce sweep ------------------------------------------------------------------------

def nccl_rows(data: dict | None = None) -> list[dict]:
    data = data or load("nccl")
    system, op, n = SYSTEMS[data["system"]], data["op"], data["gpus"]
    rows = []
    for nbytes, measured_us, busbw in data["rows"]:
        ours, algo = nccl.collective_s(system, op, nbytes, n)
        theirs = torch_estimate.collective_s(system, op, nbytes, n)
        rows.append({"bytes": nbytes, "measured_us": measured_us, "busbw_GBps": busbw, "ours_us": ours * 1e6,
                     "algorithm": algo, "torch_us": theirs * 1e6, "ours_error": _err(ours * 1e6, measured_us),
                     "torch_error": _err(theirs * 1e6, measured_us),
                     "scored": nbytes >= data["score_from_bytes"]})
    return rows


def mean_abs(rows: list[dict], key: str) -> float:
    """Mean |relative error| over `rows` (0 for none)."""
    vals = [abs(r[key]) for r in rows]
    return sum(vals) / len(vals) if vals else 0.0


# --- torch's DDP benchmark on V100s -------------------------------------------------------------------

RESNETS = {  # blocks per stage, groups, width per group (torchvision's resnet50, resnet101, resnext*)
    "resnet50": ((3, 4, 6, 3), 1, 64), "resnet101": ((3, 4, 23, 3), 1, 64),
    "resnext50_32x4d": ((3, 4, 6, 3), 32, 4), "resnext101_32x8d": ((3, 4, 23, 3), 32, 8),
}


def resnet_parameters(name: str, image: int = 224, classes: int = 1000) -> list[dict]:
    """torchvision's ResNet/ResNeXt parameters in registration order, each with its module's forward
    FLOPs per image (`backward_flops` is twice that: a convolution's backward computes two products
    of its forward's size; a batch norm's parameters share its convolution's count / 100, a token
    amount) and its unit (the block, for ZeRO-3)."""
    if name not in RESNETS:
        raise PredictError(f"unknown model {name!r}; options: {', '.join(RESNETS)}")
    blocks, groups, width_per_group = RESNETS[name]
    out: list[dict] = []

    def conv(unit, label, cin, cout, k, hw, g=1):
        flops = 2 * k * k * cin // g * cout * hw * hw
        out.append({"name": f"{unit}.{label}.weight", "numel": k * k * cin // g * cout,
                    "backward_flops": 2 * flops, "unit": unit})
        return flops

    def bn(unit, label, c, flops):
        for part in ("weight", "bias"):
            out.append({"name": f"{unit}.{label}.{part}", "numel": c, "backward_flops": flops / 100, "unit": unit})

    f = conv("stem", "conv1", 3, 64, 7, image // 2)
    bn("stem", "bn1", 64, f)
    inplanes, hw = 64, image // 4
    for stage, (count, planes) in enumerate(zip(blocks, (64, 128, 256, 512))):
        width = planes * width_per_group // 64 * groups
        for b in range(count):
            stride = 2 if stage > 0 and b == 0 else 1
            unit, out_hw = f"layer{stage + 1}.{b}", hw // stride
            bn(unit, "bn1", width, conv(unit, "conv1", inplanes, width, 1, hw))
            bn(unit, "bn2", width, conv(unit, "conv2", width, width, 3, out_hw, groups))
            bn(unit, "bn3", planes * 4, conv(unit, "conv3", width, planes * 4, 1, out_hw))
            if b == 0:
                bn(unit, "downsample.1", planes * 4, conv(unit, "downsample.0", inplanes, planes * 4, 1, out_hw))
            inplanes, hw = planes * 4, out_hw
    out.append({"name": "fc.weight", "numel": 2048 * classes, "backward_flops": 4 * 2048 * classes, "unit": "fc"})
    out.append({"name": "fc.bias", "numel": classes, "backward_flops": 2 * classes, "unit": "fc"})
    return out


def resnet_description(name: str, step_s: float) -> dict:
    """A model description (scale.described_workload's form) of `name` whose whole step on one GPU
    takes `step_s`: forward a third, backward two thirds, the optimizer inside them; fp32 gradients."""
    ms = step_s * 1e3
    return {"name": name, "wire_bytes": 4, "parameters": resnet_parameters(name),
            "compute_ms": {"forward": ms / 3, "backward": 2 * ms / 3, "optimizer": 0.0}}


def ddp_rows(data: dict | None = None) -> list[dict]:
    data = data or load("ddp")
    system = SYSTEMS[data["system"]]
    rows = []
    for name, m in data["models"].items():
        w = described_workload(system, resnet_description(name, m["no_ddp"]))
        for gpus, measured in m["p50"].items():
            n = int(gpus)
            kw = dict(bucket_mb=data["bucket_mb"], first_bucket_mb=data["first_bucket_mb"])
            ours = step_ms(system, w, n, "torch_ddp", **kw)
            theirs = step_ms(system, w, n, "torch_ddp", seconds=torch_estimate.seconds, **kw)
            small = step_ms(system, w, n, "torch_ddp", bucket_mb=1, first_bucket_mb=data["first_bucket_mb"])
            measured_ms = measured * 1e3
            rows.append({"model": name, "gpus": n, "measured_ms": measured_ms, "ours_ms": ours["step_ms"],
                         "torch_ms": theirs["step_ms"], "ours_error": _err(ours["step_ms"], measured_ms),
                         "torch_error": _err(theirs["step_ms"], measured_ms),
                         "exposed_ms": ours["exposed_ms"], "comm_ms": ours["comm_ms"],
                         "bucket_1mb_measured": m["bucket_1mb_vs_25mb_p75"][gpus],
                         "bucket_1mb_ours": ours["step_ms"] / small["step_ms"] - 1})
    return rows


# --- torchtitan's Llama 3 8B FSDP weak scaling -------------------------------------------------------

def llama_parameters(m: dict) -> list[dict]:
    """Llama 3's parameters in registration order (the embedding, each block: attention q, k, v, o,
    the SwiGLU feed-forward, two norms; the final norm and the output), each block a unit, the
    embedding a unit and the final norm with the output a unit (FSDP2 as torchtitan wraps it);
    backward work by matmul size."""
    d, kv, ffn, vocab = m["dim"], m["dim"] * m["kv_heads"] // m["heads"], m["ffn"], m["vocab"]
    out = [{"name": "tok_embeddings.weight", "numel": vocab * d, "backward_flops": 0.0, "unit": "embed"}]
    for i in range(m["layers"]):
        u = f"layers.{i}"
        for label, numel in (("attention.wq", d * d), ("attention.wk", d * kv), ("attention.wv", d * kv),
                             ("attention.wo", d * d), ("feed_forward.w1", d * ffn), ("feed_forward.w2", ffn * d),
                             ("feed_forward.w3", d * ffn)):
            out.append({"name": f"{u}.{label}.weight", "numel": numel, "backward_flops": 4.0 * numel, "unit": u})
        for label in ("attention_norm", "ffn_norm"):
            out.append({"name": f"{u}.{label}.weight", "numel": d, "backward_flops": 0.0, "unit": u})
    out.append({"name": "norm.weight", "numel": d, "backward_flops": 0.0, "unit": "head"})
    out.append({"name": "output.weight", "numel": vocab * d, "backward_flops": 4.0 * vocab * d, "unit": "head"})
    return out


def torchtitan_rows(data: dict | None = None) -> list[dict]:
    """The step at 8 GPUs is the measured one (compute = it minus what the replay exposes there, with
    a tenth of a millisecond's tolerance); the step at 128 predicted; scored on the growth."""
    data = data or load("torchtitan")
    system, m = SYSTEMS[data["system"]], data["model"]
    tokens = m["local_batch"] * m["seq_len"]
    measured = {int(g): tokens / tps * 1e3 for g, tps in data["tps_per_gpu"].items()}
    base_n, top_n = min(measured), max(measured)
    params = llama_parameters(m)
    rows = []
    for label, seconds in (("ddp-lab", None), ("torch's estimator", torch_estimate.seconds)):
        kw = {} if seconds is None else {"seconds": seconds}

        def at(n, compute_ms, kw=kw):
            desc = {"name": "llama3_8b", "wire_bytes": 2, "parameters": params,
                    "compute_ms": {"forward": compute_ms / 3, "backward": 2 * compute_ms / 3}}
            return step_ms(system, described_workload(system, desc), n, "fsdp", **kw)

        compute = measured[base_n]
        for _ in range(20):  # fixed point: compute + what the replay adds at 8 GPUs = the measured step
            compute -= at(base_n, compute)["step_ms"] - measured[base_n]
        base, top = at(base_n, compute), at(top_n, compute)
        growth = top["step_ms"] / base["step_ms"] - 1
        rows.append({"model": label, "compute_ms": compute, "base_gpus": base_n, "gpus": top_n,
                     "base_step_ms": base["step_ms"], "step_ms": top["step_ms"],
                     "base_exposed_ms": base["exposed_ms"], "exposed_ms": top["exposed_ms"],
                     "predicted_growth": growth, "measured_growth": measured[top_n] / measured[base_n] - 1,
                     "measured_step_ms": measured[top_n]})
    return rows


# --- torchtitan's multi-axis runs, priced by the planner -----------------------------------------------

def _multi_axis_system(data: dict):
    from dataclasses import replace

    return replace(SYSTEMS[data["system"]], memory_bytes=data["memory_gb"] * 2**30, hbm_Bps=data["hbm_Bps"])


def _priced(data: dict, row: dict, mfu: float, attention_mfu: float | None = None):
    from ddp_lab.analysis.plan.price import Layout, price
    from ddp_lab.analysis.plan.shapes import PUBLISHED, with_context

    shape = with_context(PUBLISHED[row["model"]], row["context"])
    return price(shape, _multi_axis_system(data), Layout(**row["layout"]), row["sequences"], mfu,
                 attention_mfu=attention_mfu)


def _solve(tps, target: float, low: float = 0.01, high: float = 2.0) -> float:
    """The fraction at which the increasing `tps(fraction)` is `target` (bisection)."""
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if tps(mid) < target else (low, mid)
    return (low + high) / 2


def calibrated_attention_mfu(data: dict | None = None) -> float:
    """A second calibration: attention's own MFU, from the most attention-heavy row with no context parallelism
    (Table 2's FSDP 8, CP 1 at 32K: attention 38% of the forward's FLOPs), the matmuls' MFU held at the first."""
    data = data or load("torchtitan_multi_axis")
    mfu, row = calibrated_mfu(data), data["rows"][data["attention_calibration_row"]]
    return _solve(lambda a: _priced(data, row, mfu, a).tokens_per_s_per_gpu, row["tps_per_gpu"])


def calibrated_mfu(data: dict | None = None) -> float:
    """The MFU at which the planner's price of the calibration row is its published tokens per second per GPU."""
    data = data or load("torchtitan_multi_axis")
    row = data["calibration"]
    return _solve(lambda mfu: _priced(data, row, mfu).tokens_per_s_per_gpu, row["tps_per_gpu"])


def multi_axis_rows(data: dict | None = None) -> list[dict]:
    """Every scored row: the planner's tokens per second per GPU and memory beside the published, and the published
    layout's place among the layouts the planner ranks for the same model, GPUs and batch (memory as theirs)."""
    from ddp_lab.analysis.plan.search import plan, why_runner_up_lost
    from ddp_lab.analysis.plan.shapes import PUBLISHED, with_context

    data = data or load("torchtitan_multi_axis")
    mfu, attention = calibrated_mfu(data), calibrated_attention_mfu(data)
    system = _multi_axis_system(data)
    rows = []
    for row in data["rows"]:
        single, ours = _priced(data, row, mfu), _priced(data, row, mfu, attention)  # ours: placed with both MFUs
        two = ours.tokens_per_s_per_gpu
        shape = with_context(PUBLISHED[row["model"]], row["context"])
        ranked = plan(shape, system, ours.layout.gpus, row["sequences"], mfu=mfu, attention_mfu=attention).ranked
        place = next((i for i, p in enumerate(ranked, 1) if p.layout == ours.layout), None)
        best = ranked[0] if ranked else None
        rows.append({**{k: row[k] for k in ("table", "row", "model", "context", "tps_per_gpu", "memory_gib")},
                     "ours_tps": single.tokens_per_s_per_gpu,
                     "error": _err(single.tokens_per_s_per_gpu, row["tps_per_gpu"]),
                     "attention_tps": two, "attention_error": _err(two, row["tps_per_gpu"]),
                     "attention_calibration": row is data["rows"][data["attention_calibration_row"]],
                     "ours_memory_gib": single.memory["total"] / 2**30, "fits": single.fits,
                     "binding": single.binding,
                     "place": place, "of": len(ranked),
                     "best": best.layout.describe() if best else None,
                     "best_over_published": best.tokens_per_s_per_gpu / ours.tokens_per_s_per_gpu if best else None,
                     "why": why_runner_up_lost(best, ours) if best and best.layout != ours.layout else None})
    return rows


# --- the report -------------------------------------------------------------------------------------

def _size(nbytes: int) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= k:
            return f"{nbytes / k:g} {unit}"
    return f"{nbytes} B"


def _pick(row: dict) -> str:
    """The planner's first choice for a published row: the same layout, or its own and how much faster it predicts."""
    if row["place"] == 1:
        return "the same"
    return f"{row['best']}, {row['best_over_published'] - 1:+.0%}" if row["best"] else "nothing fits"


def report() -> str:
    """Every published table against ddp-lab's prediction and torch's, as markdown."""
    lines = []
    data = load("nccl")
    rows = nccl_rows(data)
    scored = [r for r in rows if r["scored"]]
    lines += [f"### NVIDIA DGX H100, all_reduce_perf, {data['gpus']} GPUs ({cite(data)})", "",
              "| size | measured us | ddp-lab us | algorithm | error | torch's estimator us | error |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {_size(r['bytes'])} | {r['measured_us']:g} | {r['ours_us']:.1f} | {r['algorithm']} | "
              f"{r['ours_error']:+.1%} | {r['torch_us']:.1f} | {r['torch_error']:+.1%} |" for r in rows]
    lines += ["", f"mean |error| from {_size(data['score_from_bytes'])} up ({len(scored)} sizes): ddp-lab "
              f"{mean_abs(scored, 'ours_error'):.1%} (worst {max(abs(r['ours_error']) for r in scored):.1%}), "
              f"torch's estimator {mean_abs(scored, 'torch_error'):.1%} (worst "
              f"{max(abs(r['torch_error']) for r in scored):.1%}); below it ddp-lab "
              f"{mean_abs([r for r in rows if not r['scored']], 'ours_error'):.1%}"
              f" over {len(rows) - len(scored)} sizes", ""]
    data = load("ddp")
    rows = ddp_rows(data)
    lines += [f"### torch DDP benchmark, DGX-1 V100, batch 32 per GPU, {data['bucket_mb']:g} MiB buckets "
              f"({cite(data)})",
              "", "Compute: each model's 1-GPU \"no ddp\" p50 (the calibration, not scored).", "",
              "| model | GPUs | measured p50 ms | ddp-lab ms | error | exposed comm ms | torch's estimator ms | error "
              "| 1 MiB buckets, measured (p75) | 1 MiB buckets, ddp-lab |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['gpus']} | {r['measured_ms']:.0f} | {r['ours_ms']:.1f} | {r['ours_error']:+.1%} | "
              f"{r['exposed_ms']:.1f} | {r['torch_ms']:.1f} | {r['torch_error']:+.1%} | "
              f"{r['bucket_1mb_measured']:+.1%} | {-r['bucket_1mb_ours'] / (1 + r['bucket_1mb_ours']):+.1%} |"
              for r in rows]
    worst = max(rows, key=lambda r: abs(r["ours_error"]))
    lines += ["", f"mean |error| over {len(rows)} rows: ddp-lab {mean_abs(rows, 'ours_error'):.1%} (worst "
              f"{worst['ours_error']:+.1%}, {worst['model']} at {worst['gpus']} GPUs), torch's estimator "
              f"{mean_abs(rows, 'torch_error'):.1%}; the bucket columns are throughput, 1 MiB against 25 MiB", ""]
    data = load("torchtitan")
    rows = torchtitan_rows(data)
    lines += [f"### torchtitan Llama 3.1 8B, FSDP, H100 ({cite(data)})", "",
              "Compute: measured, the 8-GPU step less what the replay exposes there (the calibration, not "
              "scored); no MFU is assumed anywhere in these tables.", "",
              "| collectives | compute ms (from 8 GPUs) | step at 8 ms | exposed at 8 ms | step at 128 ms "
              "| exposed at 128 ms | predicted growth | measured growth | off by |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['compute_ms']:.0f} | {r['base_step_ms']:.0f} | {r['base_exposed_ms']:.1f} | "
              f"{r['step_ms']:.0f} | {r['exposed_ms']:.1f} | {r['predicted_growth']:+.2%} | "
              f"{r['measured_growth']:+.2%} "
              f"| {100 * (r['predicted_growth'] - r['measured_growth']):+.2f} points |" for r in rows]
    data = load("torchtitan_multi_axis")
    rows, mfu, attention = multi_axis_rows(data), calibrated_mfu(data), calibrated_attention_mfu(data)
    lines += ["", f"### torchtitan Llama 3.1, FSDP + TP + PP + CP, up to 512 H100s ({cite(data)})", "",
              f"Priced by the planner (`python -m ddp_lab.plan`) at MFU {mfu:.3f}: the MFU that makes its price of "
              f"Table 1's FSDP + torch.compile + Float8 row ({data['calibration']['tps_per_gpu']} tokens/s per GPU, 8 "
              "GPUs) the published one (the calibration, not scored). Memory: the planner's bf16 accounting against "
              "theirs (Float8). Place: where the published layout ranks among the layouts that fit, for the row's "
              "model, GPUs and batch, priced with both MFUs. With attention at its own MFU: attention's scores and "
              f"weighted sum (a kernel Float8 does not speed up) at MFU {attention:.3f}, the one that makes the first "
              "row exact (a second calibration, not scored).", "",
              "| table | row | context | published tok/s/GPU | planner | error | with attention at its own MFU | error "
              "| published GiB | planner GiB | place | the planner's pick, and by how much |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['table']} | {r['row']} | {r['context']} | {r['tps_per_gpu']} | {r['ours_tps']:.0f} | "
              f"{r['error']:+.0%} | {r['attention_tps']:.0f} | "
              f"{'calibration' if r['attention_calibration'] else format(r['attention_error'], '+.0%')} | "
              f"{r['memory_gib']} | {r['ours_memory_gib']:.1f}{'' if r['fits'] else ' (no fit)'} | "
              f"{r['place'] or 'does not fit'} of {r['of']} | "
              f"{_pick(r)} |"
              for r in rows]
    worst = max(rows, key=lambda r: abs(r["error"]))
    scored = [r for r in rows if not r["attention_calibration"]]
    second = max(scored, key=lambda r: abs(r["attention_error"]))
    lines += ["", f"mean |error| over {len(rows)} rows: {mean_abs(rows, 'error'):.0%} (worst {worst['error']:+.0%}, "
              f"table {worst['table']}, {worst['row']}); with attention at its own MFU, over the {len(scored)} other "
              f"rows: {mean_abs(scored, 'attention_error'):.0%} (worst {second['attention_error']:+.0%}, table "
              f"{second['table']}, {second['row']})", ""]
    return "\n".join(lines)
