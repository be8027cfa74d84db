"""strategy=demo (strategies/demo.py): replicas identical after every step, what it reduces to with every
coefficient kept, its DCT, top-k and scatter-mean on hand-made cases, and its byte count.

- Every rank ends every step with the same weights (2 and 3 ranks; frozen, tied, the Transformer), and the
  loss falls.
- topk = chunk² (every coefficient sent): the update is sign-SGD with decoupled weight decay on the
  data-parallel gradient, θ ← θ(1 - lr·wd) - lr·sign(mean_r g_r) (derivation: the module docstring). The
  reference does exactly that on one process over the whole batch; it matches but where the mean gradient
  is within rounding of 0 (there the DCT round trip may flip a sign: 2·lr for that element).
- With topk = 1 the same run lands elsewhere (the guard: the check above can fail).
"""

from __future__ import annotations

import torch

from ddp_lab.check.models import MODELS
from ddp_lab.check.parity import data_cfg, train_distributed
from ddp_lab.check.ranks import run_ranks
from ddp_lab.rank.data import BatchSource
from ddp_lab.rank.step import train_step
from ddp_lab.strategies import DeMo
from ddp_lab.strategies.demo import Blocks, dct_basis, largest_divisor_at_most
from tests.helpers.distributed import ranks_fixture
from tests.helpers.sign_sgd import SignSGD

LR, WD, STEPS = 1e-2, 0.1, 4


def _steps(rank, world_size, model_name, topk, chunk):
    """Each step's weights on this rank, the losses, the comm figures and facts."""
    torch.manual_seed(rank)
    wrapper = DeMo(MODELS[model_name](), topk=topk, chunk=chunk)
    optimizer = wrapper.make_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
    batches = BatchSource(data_cfg(batch_size=4 * world_size), rank, world_size, torch.device("cpu"))
    weights, losses, comm = [], [], []
    for step in range(8):
        losses.append(train_step(wrapper, optimizer, list(batches.micro_batches(step))).item())
        weights.append(torch.cat([p.detach().reshape(-1) for p in wrapper.parameters()]).clone())
        comm.append(wrapper.comm.pop())
    return weights, losses, comm, wrapper.facts()


def _run(rank, world_size, models):
    out = {name: _steps(rank, world_size, name, 4, 8) for name in models}
    if world_size == 2:
        every = lambda m: DeMo(m, topk=1, chunk=1)  # noqa: E731  (1 x 1 blocks: every coefficient, an exact DCT)
        every_dct = lambda m: DeMo(m, topk=64, chunk=8)  # noqa: E731  (chunk² = 64: every coefficient)
        one = lambda m: DeMo(m, topk=1, chunk=8)  # noqa: E731
        for key, make, steps in (("every", every, STEPS), ("every_dct", every_dct, 1), ("one", one, STEPS)):
            out[key] = train_distributed(rank, world_size, make, "transformer", optimizer_cls=SignSGD,
                                         opt_kwargs={"lr": LR, "weight_decay": WD}, steps=steps,
                                         batch_size=4 * world_size, exact_reference=True)
    return out


two = ranks_fixture(_run, 2, ("frozen", "tied", "transformer"))


def _identical_every_step(results):
    for name, per_rank in results.items():
        first, *others = per_rank
        for other in others:
            for step, (a, b) in enumerate(zip(first[0], other[0])):
                assert torch.equal(a, b), f"{name}: ranks differ after step {step}"
        losses = first[1]
        assert losses[-1] < losses[0], (name, losses)


def test_replicas_are_identical_after_every_step(two):
    _identical_every_step({name: [r[name] for r in two] for name in ("frozen", "tied", "transformer")})


def test_replicas_are_identical_at_an_odd_world_size():
    results = run_ranks(_run, 3, ("tied",))
    _identical_every_step({"tied": [r["tied"] for r in results]})


def test_every_coefficient_kept_is_sign_sgd_on_the_mean_gradient(two):
    """1 x 1 blocks: the DCT is multiplication by 1.0, nothing stays in the momentum, the scatter-mean of two
    ranks is (g0 + g1) / 2, the reference's accumulated gradient: bit for bit, 4 steps."""
    (state, reference), _ = two[0]["every"], two[1]["every"]
    for name, expected in reference.items():
        assert torch.equal(state[name], expected), name


def test_every_coefficient_kept_through_a_real_dct(two):
    """8 x 8 blocks, all 64 coefficients, one step: equal but where the mean gradient is within the DCT round
    trip's rounding of 0 (there its sign is the rounding's): the embedding's rows of tokens no rank saw,
    whose gradient is exactly 0 but share blocks with rows that have one, and a few others."""
    (state, reference), _ = two[0]["every_dct"], two[1]["every_dct"]
    for name, expected in reference.items():
        diff = (state[name] - expected).abs()
        assert diff.max() <= 2 * LR + 1e-6, name
        flipped = int((diff > 1e-6).sum())
        assert name.startswith("embed") or flipped <= 0.01 * diff.numel(), (name, flipped)


def test_one_coefficient_per_block_is_not_sign_sgd(two):
    (state, reference), _ = two[0]["one"], two[1]["one"]
    differ = sum(int(((state[n] - t).abs() > 1e-5).sum()) for n, t in reference.items())
    assert differ > 0.1 * sum(t.numel() for t in reference.values())


def test_bytes_are_what_one_rank_sends(two):
    _, _, comm, facts = two[0]["transformer"]
    model = MODELS["transformer"]()
    blocks = [Blocks(p.shape, 8, 4, {}) for p in model.parameters()]
    sent = sum(b.count * b.k for b in blocks) * 6  # fp32 value + int16 index per pair
    assert facts["demo"]["bytes_sent_per_step"] == sent
    assert facts["demo"]["fp32_gradient_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    assert all(c["comm_bytes"] == 2 * sent and c["collectives"] == 1 for c in comm)


# --- the parts, on hand-made cases (one process) --------------------------------------------------------------

def test_dct_basis_is_orthonormal_and_a_constant_has_one_coefficient():
    basis = dct_basis(8)
    torch.testing.assert_close(basis @ basis.T, torch.eye(8), atol=1e-6, rtol=0)
    coefficients = basis @ torch.ones(8)
    torch.testing.assert_close(coefficients, torch.tensor([8 ** 0.5] + [0.0] * 7), atol=1e-6, rtol=0)


def test_chunk_sides_are_the_largest_divisor_not_above_chunk():
    assert [largest_divisor_at_most(n, 64) for n in (128, 96, 10, 7, 1)] == [64, 48, 10, 7, 1]


def test_blocks_round_trip_and_keep_the_largest_coefficients():
    torch.manual_seed(0)
    x = torch.randn(12, 16)
    blocks = Blocks(x.shape, 4, 3, {})
    assert (blocks.count, blocks.per_block, blocks.k) == (12, 16, 3)
    coefficients = blocks.encode(x)
    torch.testing.assert_close(blocks.decode(coefficients), x, atol=1e-5, rtol=0)
    index, value = blocks.top(coefficients)
    top = coefficients.abs().sort(dim=-1, descending=True).values[:, :3]
    torch.testing.assert_close(value.abs().sort(dim=-1, descending=True).values, top)
    vector = Blocks(torch.Size([10]), 4, 2, {})  # 10 in runs of 2 (its largest divisor <= 4)
    assert (vector.count, vector.per_block, vector.k) == (5, 2, 2)
    torch.testing.assert_close(vector.decode(vector.encode(torch.arange(10.0))), torch.arange(10.0))


def test_scatter_mean_averages_over_the_ranks_that_sent_an_index():
    blocks = Blocks(torch.Size([4]), 4, 2, {})
    index = torch.tensor([[0, 1, 1, 3]])  # rank 0 sent 0 and 1, rank 1 sent 1 and 3
    values = torch.tensor([[2.0, 4.0, 6.0, -1.0]])
    assert blocks.scatter_mean(index, values).tolist() == [[2.0, 5.0, 0.0, -1.0]]
