"""Overlap is real: OverlapDDP and BucketedDDP issue all-reduces while backward is still computing.

Deterministic, not timing-based: each rank logs, in one list and in the order they happen,
every `dist.all_reduce` call, the moment backward reaches the first layer (a hook on the gradient
of the embedding's output: every later layer is done, the embedding's own gradient is not), and
the return of `backward()`. An overlapped strategy must issue its first all-reduce before the
first-layer marker; NaiveDDP and FlatDDP must issue none before backward returns. BucketedDDP
with one bucket larger than the model is the control: its only all-reduce waits for the last
gradient (the embedding's), so it comes after the marker.
"""

import time
from contextlib import contextmanager
from functools import partial

import pytest
import torch.distributed as dist

from ddp_lab.check.models import tiny_transformer
from ddp_lab.check.parity import global_batch, loss_of
from ddp_lab.check.ranks import run_ranks
from ddp_lab.strategies import BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP, TorchDDP

WRAPPERS = {
    "naive": NaiveDDP,
    "flat": FlatDDP,
    "overlap": OverlapDDP,
    "bucketed_small": partial(BucketedDDP, bucket_mb=2.0**-4),  # 64 KiB: 2 buckets on this model
    "bucketed_one_bucket": partial(BucketedDDP, bucket_mb=1000.0),
    "torch_ddp": partial(TorchDDP, bucket_mb=2.0**-4),
}
STEPS = 3
# torch DDP's first bucket holds 1 MiB (this whole model) until it rebuilds its buckets after
# step 0, so its step 0 cannot overlap; ours overlap from step 0.
FIRST_OVERLAPPED_STEP = {"overlap": 0, "bucketed_small": 0, "torch_ddp": 1}


@contextmanager
def logged_all_reduce(events: list):
    original = dist.all_reduce

    def logging_all_reduce(*args, **kwargs):
        events.append("all_reduce")
        return original(*args, **kwargs)

    dist.all_reduce = logging_all_reduce
    try:
        yield
    finally:
        dist.all_reduce = original


def _event_logs(rank, world_size):
    logs = {}
    for name, make in WRAPPERS.items():
        model = tiny_transformer()
        events: list = []

        def mark_first_layer(module, args, out, events=events):
            out.register_hook(lambda grad: events.append("first_layer_grad"))

        model.embed.register_forward_hook(mark_first_layer)
        ddp = make(model)
        steps = []
        for step in range(STEPS):
            events.clear()
            with logged_all_reduce(events):
                loss_of(ddp, global_batch(step)[rank::world_size]).backward()
                events.append("backward_end")
                backward_end = time.perf_counter()
                ddp.finish_gradient_synchronization()
            first_start = min(start for start, _ in ddp.comm.intervals)
            ddp.comm.pop()
            steps.append((list(events), first_start < backward_end))
        logs[name] = steps
    return logs


@pytest.fixture(scope="module")
def logs():
    return run_ranks(_event_logs, 2)


def _first(events, what):
    return events.index(what) if what in events else len(events)


@pytest.mark.parametrize("name", ["overlap", "bucketed_small", "torch_ddp"])
def test_overlapped_strategies_launch_during_backward(logs, name):
    for rank, per_rank in enumerate(logs):
        for step, (events, started_before_backward_end) in enumerate(per_rank[name]):
            if step < FIRST_OVERLAPPED_STEP[name]:
                continue
            assert _first(events, "all_reduce") < _first(events, "first_layer_grad"), (rank, step, events)
            # The recorded in-flight interval starts at the launch, not when finish() waits for it.
            assert started_before_backward_end, (rank, step)


@pytest.mark.parametrize("name", ["naive", "flat"])
def test_synchronous_strategies_wait_for_backward(logs, name):
    for rank, per_rank in enumerate(logs):
        for step, (events, started_before_backward_end) in enumerate(per_rank[name]):
            assert "all_reduce" in events
            assert _first(events, "all_reduce") > events.index("backward_end"), (rank, step, events)
            assert not started_before_backward_end, (rank, step)


def test_one_bucket_larger_than_the_model_cannot_overlap(logs):
    for per_rank in logs:
        for events, _ in per_rank["bucketed_one_bucket"]:
            assert events.count("all_reduce") == 1
            assert events.index("first_layer_grad") < events.index("all_reduce") < events.index("backward_end")


def test_overlap_launches_most_parameters_before_the_first_layer(logs):
    """Per-parameter launches: all but the embedding's own are issued before backward reaches it."""
    n_params = sum(1 for _ in tiny_transformer().parameters())
    for per_rank in logs:
        for events, _ in per_rank["overlap"]:
            assert events[:_first(events, "first_layer_grad")].count("all_reduce") == n_params - 1, events
