"""The bucket plan, by sizes alone: what strategies/bucketed.py builds and the predictor replays."""

from __future__ import annotations

from ddp_lab.units import MiB

DEFAULT_BUCKET_MB = 25.0
"""torch DDP's `bucket_cap_mb` default, and every bucketed strategy's (`strategy.bucket_mb`)."""


def plan_bucket_indices(nbytes, kinds, bucket_mb: float) -> list[list[int]]:
    """Bucket plan by sizes alone: indices of tensors of `nbytes` (and `kinds`: dtype/device, a change
    closes a bucket) grouped in reverse order, each bucket at most `bucket_mb` MiB unless one tensor
    is larger. strategies/bucketed.py plans real buckets with it; the step-time predictor replays them.
    """
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be a number > 0, got {bucket_mb!r}")
    cap = bucket_mb * MiB
    buckets: list[list[int]] = []
    current: list[int] = []
    size, kind = 0, None
    for i in reversed(range(len(nbytes))):
        if current and (size + nbytes[i] > cap or kinds[i] != kind):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes[i]
        kind = kinds[i]
    if current:
        buckets.append(current)
    return buckets
