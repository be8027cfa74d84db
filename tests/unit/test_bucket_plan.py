"""BucketedDDP's bucket plan equals buckets computed by hand (sizes in MiB, 2^20 bytes)."""

import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.strategies import BucketedDDP, plan_buckets

KIB = 1024
MIB = 2**20


def three_layers() -> nn.Sequential:
    """Parameters in order, with float32 bytes: w0 256 KiB, b0 1 KiB, w1 512 KiB, b1 2 KiB,
    w2 256 KiB, b2 0.5 KiB. Buckets fill in reverse: b2, w2, b1, w1, b0, w0."""
    return nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 512), nn.Linear(512, 128))


def sizes_mb(params, buckets):
    return [sum(params[i].numel() * params[i].element_size() for i in bucket) / MIB for bucket in buckets]


def test_hand_computed_buckets():
    params = list(three_layers().parameters())
    # Cap 0.5 MiB: b2+w2+b1 = 0.5+256+2 KiB; adding w1 (512 KiB) would pass the cap, so a new
    # bucket; w1 alone is exactly the cap (allowed); b0 starts the third bucket with w0.
    buckets = plan_buckets(params, 0.5)
    assert buckets == [[5, 4, 3], [2], [1, 0]]
    assert sizes_mb(params, buckets) == [(0.5 + 256 + 2) * KIB / MIB, 0.5, (1 + 256) * KIB / MIB]
    assert sizes_mb(params, buckets) == [0.25244140625, 0.5, 0.2509765625]


def test_parameter_larger_than_the_cap_gets_its_own_bucket():
    params = list(three_layers().parameters())
    # Cap 0.3 MiB: w1 (0.5 MiB) is over the cap on its own.
    assert plan_buckets(params, 0.3) == [[5, 4, 3], [2], [1, 0]]
    # Cap 0.2 MiB: every weight is over it, and a bucket holding an oversized weight takes nothing
    # else, so every parameter ends up alone.
    assert plan_buckets(params, 0.2) == [[5], [4], [3], [2], [1], [0]]


def test_extreme_caps():
    params = list(three_layers().parameters())
    assert plan_buckets(params, 1e-6) == [[i] for i in reversed(range(len(params)))]
    assert plan_buckets(params, 1000) == [list(reversed(range(len(params))))]


def test_dtype_change_splits_a_bucket():
    params = [torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)]
    assert plan_buckets(params, 1000) == [[2, 1], [0]]


@pytest.mark.parametrize("bad", [0, -1.0, math.nan])
def test_bucket_mb_must_be_positive(bad):
    with pytest.raises(ValueError, match="bucket_mb"):
        plan_buckets(list(three_layers().parameters()), bad)


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def test_wrapper_reports_its_plan_without_frozen_or_duplicate_parameters(one_rank):
    model = nn.Sequential(nn.Linear(512, 128), nn.Linear(128, 512), nn.Linear(512, 128))
    model[2].weight = model[0].weight   # tied (128 x 512, 256 KiB): one gradient, in one bucket
    model[1].requires_grad_(False)      # frozen: in no bucket
    ddp = BucketedDDP(model, bucket_mb=0.25)
    # Trainable, in parameters() order: w0 (256 KiB), b0 (0.5 KiB), b2 (0.5 KiB).
    # Reverse: b2 + b0 = 1 KiB; adding w0 would pass 256 KiB, so w0 gets the second bucket.
    assert ddp.bucket_sizes_mb == [1 * KIB / MIB, 0.25]
    assert [b.numel() * b.element_size() / MIB for b in ddp._bucket_buffers] == ddp.bucket_sizes_mb
