"""The awkward steps for the hook-driven wrappers (see ddp_lab/strategies/hooked.py for the rules).

- A parameter used on one rank only, or on none, does not hang the step; every rank ends with
  the same averaged gradient (zeros standing in for a missing one).
- Evaluation forwards (`eval()`, `torch.no_grad()`) issue no collective and arm no hook; a
  backward they did not arm is still reduced by `finish_gradient_synchronization()`.
- `no_sync()` backward issues no collective.
- A second backward without no_sync raises instead of reducing a gradient twice.
- BucketedDDP's buffers are allocated once and `.grad` is a view into them, which autograd
  writes in place (with `zero_grad(set_to_none=True)` too): no copy in or out.
- Comm accounting counts one collective per bucket (per parameter for OverlapDDP) and every byte.
All cases share one 2-rank run.
"""

import copy
from contextlib import contextmanager
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.check.models import VOCAB, BranchyNet, tiny_transformer
from ddp_lab.check.parity import global_batch, loss_of
from ddp_lab.check.ranks import run_ranks
from ddp_lab.strategies import BucketedDDP, OverlapDDP, TorchDDP

HOOKED = {
    "overlap": OverlapDDP,
    "bucketed_tiny": partial(BucketedDDP, bucket_mb=1e-6),
    "bucketed_2kib": partial(BucketedDDP, bucket_mb=2.0**-9),
    "bucketed_huge": partial(BucketedDDP, bucket_mb=1000.0),
}
ALL = {**HOOKED, "torch_ddp": partial(TorchDDP, bucket_mb=2.0**-9)}


def _loss(model, tokens, *extra):
    logits = model(tokens[:, :-1], *extra)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


@contextmanager
def counted_all_reduce():
    calls = [0]
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = original


def _unused_parameters(rank, world_size, make, set_to_none):
    """Per step, the average of each rank's local gradient (zeros where a rank had none)."""
    torch.manual_seed(0)  # same init everywhere, so a plain copy can compute local gradients
    model = BranchyNet()
    plain = copy.deepcopy(model)
    ddp = make(model)
    uses = [rank == 0, rank == 1, False]  # divergent, divergent the other way, unused everywhere
    out = []
    for step, use_branch in enumerate(uses):
        tokens = global_batch(step)[rank::world_size]
        for m in (ddp.module, plain):
            m.zero_grad(set_to_none=set_to_none)
        _loss(ddp, tokens, use_branch).backward()
        ddp.finish_gradient_synchronization()
        _loss(plain, tokens, use_branch).backward()
        expected = {}
        for name, p in plain.named_parameters():
            local = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(local)
            expected[name] = local / world_size
        got = {name: (p.grad.clone() if p.grad is not None else None) for name, p in ddp.module.named_parameters()}
        out.append((got, expected))
    return out


def _evaluation_forwards(rank, world_size, make):
    """Collectives issued by eval forwards, and whether training around them still matches."""
    torch.manual_seed(rank)
    ddp = make(tiny_transformer())
    reference = copy.deepcopy(ddp.module)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    eval_collectives, unarmed_backward_collectives = 0, None
    for step in range(3):
        batch = global_batch(step)
        with counted_all_reduce() as calls:
            with torch.no_grad():
                ddp(batch[:, :-1])                      # e.g. validation under no_grad
            ddp.eval()
            ddp(batch[:, :-1])                          # eval forward with grad on, no backward
            ddp.train()
        eval_collectives += calls[0]
        optimizer.zero_grad()
        if step == 1:
            ddp.eval()                                  # an unarmed backward: finish() reduces it
        with counted_all_reduce() as calls:
            _loss(ddp, batch[rank::world_size]).backward()
        if step == 1:
            unarmed_backward_collectives = calls[0]
        ddp.train()
        ddp.finish_gradient_synchronization()
        optimizer.step()
        ref_optimizer.zero_grad()
        _loss(reference, batch).backward()
        ref_optimizer.step()
    same = all(torch.allclose(a, b, atol=1e-5, rtol=1e-4)
               for a, b in zip(ddp.module.state_dict().values(), reference.state_dict().values()))
    return eval_collectives, unarmed_backward_collectives, same


def _no_sync_and_double_backward(rank, world_size, make):
    ddp = make(tiny_transformer())
    batch = global_batch(0)[rank::world_size]
    with counted_all_reduce() as calls:
        with ddp.no_sync():
            loss_of(ddp, batch).backward()
    in_no_sync = calls[0]
    error = None
    if not isinstance(ddp, TorchDDP):
        loss_of(ddp, batch).backward()
        try:
            loss_of(ddp, batch).backward()
        except RuntimeError as e:
            error = str(e)
    ddp.finish_gradient_synchronization()  # drains what the first backward launched
    return in_no_sync, error


def _in_a_bucket(ptr, ddp):
    return any(b.data_ptr() <= ptr < b.data_ptr() + b.numel() * b.element_size() for b in ddp._bucket_buffers)


def _views_and_accounting(rank, world_size, set_to_none):
    model = tiny_transformer()
    # Registered before the wrapper's hooks, so it sees .grad exactly as autograd left it.
    autograd_wrote = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: autograd_wrote.append(p.grad.data_ptr()))
    ddp = BucketedDDP(model, bucket_mb=2.0**-4)
    buffers = [b.data_ptr() for b in ddp._bucket_buffers]
    params = list(ddp.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    report = []
    for step in range(3):
        optimizer.zero_grad(set_to_none=set_to_none)
        autograd_wrote.clear()
        loss_of(ddp, global_batch(step)[rank::world_size]).backward()
        written_in_place = len(autograd_wrote) == len(params) and all(_in_a_bucket(ptr, ddp) for ptr in autograd_wrote)
        ddp.finish_gradient_synchronization()
        stats = ddp.comm.pop()
        inside = all(_in_a_bucket(p.grad.data_ptr(), ddp) for p in params)
        report.append((written_in_place, inside, [b.data_ptr() for b in ddp._bucket_buffers] == buffers,
                       stats["collectives"] == len(ddp._bucket_buffers), stats["comm_bytes"] == grad_bytes,
                       stats["comm_ms"] > 0))
        optimizer.step()
    overlap = OverlapDDP(tiny_transformer())
    loss_of(overlap, global_batch(0)[rank::world_size]).backward()
    overlap.finish_gradient_synchronization()
    stats = overlap.comm.pop()
    n_params = len(list(overlap.parameters()))
    return report, (stats["collectives"] == n_params, stats["comm_bytes"] == grad_bytes)


def _all_cases(rank, world_size):
    return {
        "unused": {(name, to_none): _unused_parameters(rank, world_size, make, to_none)
                   for name, make in HOOKED.items() for to_none in (True, False)},
        "eval": {name: _evaluation_forwards(rank, world_size, make) for name, make in ALL.items()},
        "no_sync": {name: _no_sync_and_double_backward(rank, world_size, make) for name, make in ALL.items()},
        "views": {to_none: _views_and_accounting(rank, world_size, to_none) for to_none in (True, False)},
    }


@pytest.fixture(scope="module")
def cases():
    return run_ranks(_all_cases, 2)


def test_unused_parameters_do_not_hang_and_are_averaged(cases):
    for rank, per_rank in enumerate(cases):
        for key, steps in per_rank["unused"].items():
            for step, (got, expected) in enumerate(steps):
                for name, grad in expected.items():
                    assert got[name] is not None, (key, rank, step, name)
                    where = f"{key} rank {rank} step {step} {name}"
                    torch.testing.assert_close(got[name], grad, msg=lambda m, where=where: f"{where}: {m}")
                # ranks agree bit for bit: they hold the same reduced buffer
                for name, grad in got.items():
                    assert torch.equal(grad, cases[0]["unused"][key][step][0][name])
            never = steps[0][0]["never.weight"]
            assert torch.count_nonzero(never) == 0  # used by no rank: a zero gradient, not None


@pytest.mark.parametrize("name", list(ALL))
def test_evaluation_forwards_issue_nothing_and_training_still_matches(cases, name):
    for per_rank in cases:
        eval_collectives, unarmed_backward_collectives, same = per_rank["eval"][name]
        assert eval_collectives == 0
        assert unarmed_backward_collectives == 0
        assert same


@pytest.mark.parametrize("name", list(ALL))
def test_no_sync_backward_issues_nothing(cases, name):
    for per_rank in cases:
        assert per_rank["no_sync"][name][0] == 0


@pytest.mark.parametrize("name", list(HOOKED))
def test_second_backward_without_no_sync_is_refused(cases, name):
    for per_rank in cases:
        assert "no_sync" in per_rank["no_sync"][name][1]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_bucket_buffers_are_reused_and_grads_are_views(cases, set_to_none):
    for per_rank in cases:
        report, overlap_accounting = per_rank["views"][set_to_none]
        for step, checks in enumerate(report):
            assert all(checks), (step, checks)
        assert all(overlap_accounting)
