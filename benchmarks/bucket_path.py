"""Where the bucket path's time goes: the lab's bucketed beside the floor and torch's DDP in a bare loop on one
device, then the bucket path with one ingredient at a time taken out (docs/measured/gpu.md, "The bucket path").

Every row runs the trainer's own step (rank/step.py `train_step`, `StepTimer`) on a freshly built model at one
rank, so nothing of launch.py (torchrun, Hydra, the recorder) is in it; a row that is slow here is slow for a
reason inside the step. The rows:

- `none`, `torch_ddp`, `torch_ddp_bare` (figures off: torch's DDP with none of the lab's hooks), `overlap`,
  `bucketed` (figures on and off, and at 1 and 1000 MiB buckets: a cost per bucket moves with their count);
- `bucketed_no_views`: `.grad` never pointed into the buckets before forward (autograd allocates each gradient,
  the hook copies it in, as torch's DDP does after `zero_grad(set_to_none=True)`);
- `bucketed_no_launch`: no collective at all (each unit's future completes at once);
- `bucketed_unarmed`: no hook launches anything; every bucket goes at the end of backward;
- `hooks_only`: the plain model with a no-op Python post-accumulate-grad hook on every parameter;
- `views_only`: the plain model with every `.grad` pointed into 25 MiB buffers before forward, nothing else.

Then one step each of the floor, bucketed and torch_ddp under `torch.cuda.set_sync_debug_mode("warn")` (every
call that waits for the device, counted) and under torch.profiler (host and device time, the top operations).

    python benchmarks/bucket_path.py --device cuda --out OUT        # OUT/bucket_path.json, OUT/*.txt
    python benchmarks/bucket_path.py --device cpu --model tiny --rows none,bucketed   # the same rows on gloo
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddp_lab.models.transformer import Transformer  # noqa: E402
from ddp_lab.rank.precision import Precision  # noqa: E402
from ddp_lab.rank.step import train_step  # noqa: E402
from ddp_lab.rank.timing import StepTimer  # noqa: E402
from ddp_lab.spec.strategies import SPECS  # noqa: E402
from ddp_lab.strategies import BucketedDDP, NoSync, OverlapDDP, TorchDDP  # noqa: E402
from ddp_lab.strategies.comm_stats import set_per_collective  # noqa: E402
from ddp_lab.tasks.train import wrap  # noqa: E402

MODELS = {"tiny": dict(d_model=256, d_ff=1024, num_layers=4, num_heads=4),
          "medium": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
          "xl": dict(d_model=1600, d_ff=6400, num_layers=48, num_heads=25)}


class NoViews(BucketedDDP):
    def _point_grads_at_buckets(self) -> None:
        pass


class NoLaunch(BucketedDDP):
    def _launch_unit(self, index):
        from ddp_lab.strategies.comm_stats import Stamp

        future = torch.futures.Future()
        future.set_result(self._unit_tensor(index))
        return future, Stamp(0)


class Unarmed(BucketedDDP):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        self._armed = False
        return out


class HooksOnly(NoSync):
    def __init__(self, module, **kw):
        super().__init__(module, **kw)
        for p in self.trainable_parameters():
            p.register_post_accumulate_grad_hook(lambda param: None)


class ViewsOnly(NoSync):
    bucket_mb = 25

    def __init__(self, module, **kw):
        super().__init__(module, **kw)
        trainable = self.trainable_parameters()
        from ddp_lab.strategies.bucketed import plan_buckets

        self._views = []
        for bucket in plan_buckets(trainable, self.bucket_mb):
            params = [trainable[i] for i in bucket]
            buffer = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
            offset = 0
            for p in params:
                self._views.append((p, buffer[offset:offset + p.numel()].view_as(p), buffer))
                offset += p.numel()

    def forward(self, *args, **kwargs):
        if self.training and torch.is_grad_enabled():
            zeroed = set()
            for p, view, buffer in self._views:
                if p.grad is None:
                    if id(buffer) not in zeroed:
                        buffer.zero_()
                        zeroed.add(id(buffer))
                    p.grad = view
        return self.module(*args, **kwargs)


class OwnBuffers(ViewsOnly):
    bucket_mb = 1e-9  # every parameter a bucket of its own: a zeroed buffer each, no slices of a shared one


ROWS = {
    "none": (NoSync, {}, True),
    "torch_ddp": (TorchDDP, {}, True),
    "torch_ddp_bare": (TorchDDP, {}, False),
    "overlap": (OverlapDDP, {}, True),
    "bucketed": (BucketedDDP, {}, True),
    "bucketed_off": (BucketedDDP, {}, False),
    "bucketed_1mb": (BucketedDDP, {"bucket_mb": 1}, True),
    "bucketed_1000mb": (BucketedDDP, {"bucket_mb": 1000}, True),
    "bucketed_no_views": (NoViews, {}, True),
    "bucketed_no_launch": (NoLaunch, {}, True),
    "bucketed_unarmed": (Unarmed, {}, True),
    "hooks_only": (HooksOnly, {}, True),
    "views_only": (ViewsOnly, {}, True),
    "own_buffers_only": (OwnBuffers, {}, True),
    "none_main_thread": (NoSync, {}, True),
    "bucketed_main_thread": (BucketedDDP, {}, True),
    "none_progress": (NoSync, {}, True),
    "bucketed_progress": (BucketedDDP, {}, True),
    "torch_ddp_progress": (TorchDDP, {}, True),
}
"""row: (class, knobs, per-collective figures); a row named *_main_thread runs backward on the calling thread
(`torch.autograd.set_multithreading_enabled(False)`), not autograd's device thread; one named *_progress runs
with a rich progress bar refreshing beside it, as the trainer's rank 0 shows one (rank/recorder.py)."""


def build(row: str, args, device):
    """(wrapper, optimizer, precision) of `row`: one of ROWS, or any strategy's name (`NAME_off`: figures off)
    wrapped as the trainer wraps it (tasks/train.py `wrap`, the strategy's default knobs)."""
    torch.manual_seed(0)
    with torch.device(args.build_on) if args.build_on else device:
        model = Transformer(vocab_size=10000, context_length=args.context, **MODELS[args.model])
    model = model.to(device)
    if row not in ROWS:
        name = row.removesuffix("_off")
        set_per_collective(name == row)
        return wrap(SPECS[name](), model, args.precision, device.type, 1e-4, 0.1)
    cls, knobs, figures = ROWS[row]
    set_per_collective(figures)
    wrapper = cls(model, **knobs)
    optimizer = wrapper.make_optimizer(torch.optim.AdamW, lr=1e-4, weight_decay=0.1)
    return wrapper, optimizer, Precision(args.precision, device.type)


def batch(args, device):
    g = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, 10000, (args.batch, args.context + 1), generator=g).to(device)
    return [(tokens[:, :-1], tokens[:, 1:])]


def timed_row(row: str, args, device) -> dict:
    wrapper, optimizer, precision = build(row, args, device)
    data = batch(args, device)
    steps = []
    threaded = not row.endswith("_main_thread")
    progress = None
    if row.endswith("_progress"):
        from rich.console import Console
        from rich.progress import Progress

        progress = Progress(console=Console(file=sys.stdout))
        task = progress.add_task("steps", total=args.warmup + args.steps)
        progress.start()
    for step in range(args.warmup + args.steps):
        timer = StepTimer(device)
        timer.start()
        with torch.autograd.set_multithreading_enabled(threaded):
            train_step(wrapper, optimizer, data, timer=timer, precision=precision)
        total = timer.stop_ms()
        wrapper.comm.pop()
        if progress is not None:
            progress.update(task, advance=1)
        if step >= args.warmup:
            steps.append({"step_ms": total, **timer.laps})
    if progress is not None:
        progress.stop()
    out = {key: statistics.median(s[key] for s in steps) for key in steps[0]}
    del wrapper, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def one_step_looked_at(row: str, args, device, out: Path) -> dict:
    """Synchronizing calls counted (CUDA's sync debug mode) and a profiler table of one step."""
    wrapper, optimizer, precision = build(row, args, device)
    data = batch(args, device)
    for _ in range(args.warmup):
        train_step(wrapper, optimizer, data, precision=precision)
        wrapper.comm.pop()
    found = {}
    if device.type == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_step(wrapper, optimizer, data, precision=precision)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        for w in caught:
            where = f"{Path(w.filename).name}:{w.lineno}"
            found[where] = found.get(where, 0) + 1
        wrapper.comm.pop()
        torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(2):
            train_step(wrapper, optimizer, data, precision=precision)
            wrapper.comm.pop()
        if device.type == "cuda":
            torch.cuda.synchronize()
    averages = prof.key_averages()
    device_attr = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
    # kernels and copies only: a CPU-side annotation (the optimizer's step) also carries the device time under it
    device_us = sum(getattr(e, device_attr, 0) for e in averages
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=25)]
    if device.type == "cuda":
        tables.append(averages.table(sort_by=device_attr, row_limit=15))
    (out / f"profile_{row}.txt").write_text("\n\n".join(tables))
    syncs = {e.key: e.count for e in averages if "Synchronize" in e.key or "Memcpy" in e.key}
    if row == "bucketed" and args.trace:
        prof.export_chrome_trace(str(out / f"trace_{row}.json"))
    del wrapper, optimizer
    gc.collect()
    return {"sync_warnings": found, "sync_calls_2_steps": syncs, "device_busy_ms_per_step": device_us / 2e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="medium", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", default=",".join(ROWS), help="ROWS' names, or any strategy's (NAME_off: figures "
                        "off), wrapped as the trainer wraps it")
    parser.add_argument("--repeat", type=int, default=1, help="run the rows this many times, interleaved (row by "
                        "row, round after round): a row's figure is the median of its rounds' p50s, its spread "
                        "their range")
    parser.add_argument("--looked-at", default="none,bucketed,torch_ddp")
    parser.add_argument("--build-on", default=None, help="build the model here, then move it (the trainer: cpu)")
    parser.add_argument("--trace", action="store_true", help="also write bucketed's chrome trace")
    parser.add_argument("--out", default="outputs/bench/bucket_path")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    results = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "args": vars(args), "rows": {}, "looked_at": {}}
    if device.type == "cuda":
        results["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    print(f"{'row':<22}{'step':>9}{'fwd+bwd':>9}{'sync':>8}{'optim':>8}  (p50 ms, {args.steps} steps)", flush=True)
    rounds: dict[str, list[dict]] = {}
    for round_ in range(args.repeat):
        for row in args.rows.split(","):
            started = time.perf_counter()
            try:
                r = timed_row(row, args, device)
            except Exception as error:  # one row's failure is reported, the rest still run
                results["rows"][row] = {"error": f"{type(error).__name__}: {error}"}
                print(f"{row:<22}failed: {type(error).__name__}: {error}", flush=True)
                continue
            rounds.setdefault(row, []).append(r)
            laps = [r.get(k, float("nan")) for k in ("step_ms", "fwd_bwd_ms", "sync_ms", "optimizer_ms")]
            print(f"{row:<22}" + "".join(f"{v:>9.1f}" for v in laps)
                  + f"   (round {round_ + 1}, {time.perf_counter() - started:.0f} s)", flush=True)
            results["rows"][row] = {key: statistics.median(x[key] for x in rounds[row]) for key in r}
            results["rows"][row]["step_ms_rounds"] = [x["step_ms"] for x in rounds[row]]
            (out / "bucket_path.json").write_text(json.dumps(results, indent=1))
    if args.repeat > 1:
        print(f"\n{'row':<22}{'step':>9}  (median of {args.repeat} rounds' p50 ms; min-max)")
        for row, r in results["rows"].items():
            if "step_ms_rounds" in r:
                print(f"{row:<22}{r['step_ms']:>9.1f}  ({min(r['step_ms_rounds']):.1f}-{max(r['step_ms_rounds']):.1f})")
    for row in filter(None, args.looked_at.split(",")):
        try:
            results["looked_at"][row] = one_step_looked_at(row, args, device, out)
        except Exception as error:
            results["looked_at"][row] = {"error": f"{type(error).__name__}: {error}"}
        print(row, json.dumps(results["looked_at"][row]), flush=True)
        (out / "bucket_path.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
