"""OverlapDDP, BucketedDDP and TorchDDP train to the single-process weights and to each other's.

The parity proof of ddp_lab/check/parity.py (different init per rank, the full batch as reference) for the
overlapped strategies, with bucket caps below every parameter, in between, and above the whole
model, on the frozen, tied and Transformer models, with and without gradient accumulation and with
`zero_grad(set_to_none=False)` (where BucketedDDP's gradients stay views into its buckets).
Every case of one world size runs in one `run_ranks` call: starting ranks is the slow part.
"""

from functools import partial

import pytest
import torch

from ddp_lab.check.models import MODELS, mid_mb
from ddp_lab.check.parity import ATOL, RTOL, assert_parity, train_distributed
from ddp_lab.check.ranks import run_ranks
from ddp_lab.strategies import BucketedDDP, OverlapDDP, TorchDDP, plan_buckets

TINY_MB = 1e-6       # 1 byte: below every parameter, so one bucket per parameter
HUGE_MB = 1000.0     # above the whole model: one bucket, FlatDDP's single all-reduce


def bucketed_mid(model):
    return BucketedDDP(model, bucket_mb=mid_mb(model))


def torch_ddp_mid(model):
    return TorchDDP(model, bucket_mb=mid_mb(model))


WRAPPERS = {
    "overlap": OverlapDDP,
    "bucketed_tiny": partial(BucketedDDP, bucket_mb=TINY_MB),
    "bucketed_mid": bucketed_mid,
    "bucketed_huge": partial(BucketedDDP, bucket_mb=HUGE_MB),
    "torch_ddp": torch_ddp_mid,
}
MODEL_NAMES = ("frozen", "tied", "transformer")
# (grad_accum_steps, set_to_none) per world size; 4 ranks take 2 samples each, so accumulate 2.
VARIANTS = {2: [(1, True), (1, False), (2, True), (2, False)], 4: [(1, True), (2, False)]}


def _everything(rank, world_size):
    return {(wrapper, model, accum, to_none): train_distributed(rank, world_size, make, model,
                                                                grad_accum_steps=accum, set_to_none=to_none)
            for wrapper, make in WRAPPERS.items()
            for model in MODEL_NAMES
            for accum, to_none in VARIANTS[world_size]}


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def results(request):
    return request.param, run_ranks(_everything, request.param)


def _cases(results, wrapper):
    world_size, per_rank = results
    for model in MODEL_NAMES:
        for accum, to_none in VARIANTS[world_size]:
            yield (model, accum, to_none), [r[(wrapper, model, accum, to_none)] for r in per_rank]


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_matches_single_process(results, wrapper):
    for case, per_rank in _cases(results, wrapper):
        try:
            assert_parity(per_rank)
        except AssertionError as error:
            raise AssertionError(f"{wrapper} {case}: {error}") from None


@pytest.mark.parametrize("wrapper", [w for w in WRAPPERS if w != "torch_ddp"])
def test_matches_torch_ddp(results, wrapper):
    for (case, ours), (_, torchs) in zip(_cases(results, wrapper), _cases(results, "torch_ddp")):
        for rank, ((state, _), (reference, _)) in enumerate(zip(ours, torchs)):
            for name, tensor in reference.items():
                torch.testing.assert_close(state[name], tensor, atol=ATOL, rtol=RTOL,
                                           msg=lambda m, n=name, r=rank, c=case: f"{wrapper} {c} rank {r}, {n}: {m}")


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_caps_cover_the_three_regimes(model):
    """Guards the choice of caps above: tiny splits every parameter, mid groups some, huge all."""
    module = MODELS[model]()
    params = [p for p in module.parameters() if p.requires_grad]
    tiny, mid, huge = (plan_buckets(params, mb) for mb in (TINY_MB, mid_mb(module), HUGE_MB))
    assert len(tiny) == len(params)
    assert 1 < len(mid) < len(params) and max(len(b) for b in mid) > 1
    assert len(huge) == 1
