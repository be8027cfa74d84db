"""Expert parallelism: the MoE layer alone in float64, and training on every layout, against one process.

The layer alone: one MoE layer (models/moe.py) over the whole batch on one process, and the same layer with its
experts split over ep ranks (ddp_lab/expert_parallel/), each rank holding its tokens: output, input gradient, router
gradient and every expert's gradient (none of them None), float64, to 1e-12, at ep 2 and 4 (and ep 2 beside a
second ep group), softmax and sigmoid routing with a selection bias, the global balancing loss, dropless and with a
capacity factor against a reference that applies capacity per rank-sized group. Every token's chosen experts are
compared too: float64 keeps near-ties from flipping between layouts (a row's router logits move with the matmul's
batch size, 5.7e-5 in fp32), and the comparison says so if one ever does. Each trap (tests/helpers/moe.py) is run
through the same comparison and must fail it, on the gradient that shows it.

Training: `train_on_mesh` with `parallel.ep` against single-process training, fp32 to rounding (check/parity.py's
ATOL 1e-5, RTOL 1e-4): at ep 2 every strategy that takes the replica map, ep with dp, cp and pp, the bias,
capacity, a shared and a frozen expert, torch's parts; a mixture at ep 1 under every exact strategy. The bytes each
rank sends, against the formula.
"""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
import torch.distributed as dist

from ddp_lab.check.ranks import run_ranks
from tests.helpers import moe as traps
from tests.parity.test_tensor_parallel import EXACT

D, E, K, H = 8, 4, 2, 12  # width, experts, top-k, expert hidden width
TOKENS = 6  # per rank


def _layer(router: str, balance: str, capacity, shared: int = 0):
    """`balance="skewed"`: a selection bias sending every token to experts 0 and 1 (the last ep rank's experts get
    no row at all, the first's every one)."""
    from ddp_lab.models.moe import MoE

    torch.manual_seed(0)
    layer = MoE(D, E, K, H, shared, router, "bias" if balance == "skewed" else balance, 0.01, capacity).double()
    with torch.no_grad():
        if balance == "skewed":
            layer.router.selection_bias.copy_(torch.tensor([10.0, 10.0] + [0.0] * (E - 2)))
        elif router == "sigmoid":
            layer.router.selection_bias.copy_(torch.linspace(-0.05, 0.05, E))  # a bias that moves choices
    return layer


def _alone(rank, world_size, ep, router="softmax", balance="aux_loss", capacity=None, trap=None, impl="lab"):
    """Errors against one process: output, input gradient, router gradient, expert gradients (the largest of
    each), the chosen experts equal (bool), no expert gradient None (bool)."""
    from ddp_lab.expert_parallel import ExpertParallel
    from ddp_lab.spec.parallel import MeshLayout

    layout = MeshLayout(world_size, ep=ep)
    parallel = ExpertParallel(layout, impl)
    layer = _layer(router, balance, capacity)
    reference = deepcopy(layer)
    reference.capacity_groups = world_size  # capacity per rank-sized group, as each rank applies it
    parallel.apply(layer)
    layer.replicas = world_size
    layer.sum_over_replicas = lambda t: dist.all_reduce(t)
    if trap in ("detached_gates", "per_rank_balance", "scores_twice"):
        getattr(traps, trap)(layer)
    elif trap in ("wrong_inverse", "no_autograd_exchange"):
        layer.exchange = getattr(traps, trap)(parallel.exchange)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(world_size * TOKENS, D, dtype=torch.float64, generator=generator)
    dout = torch.randn(world_size * TOKENS, D, dtype=torch.float64, generator=generator)
    rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
    mine = x[rows].clone().requires_grad_()
    layer.train()
    out = layer(mine)
    objective = (out * dout[rows]).sum() + (layer.pop_aux() if balance == "aux_loss" else 0)
    assert balance != "skewed" or layer.figures["load"][2:].sum() == 0  # as skewed as it says
    objective.backward()
    # What a strategy does with the replica map: dense gradients averaged over every rank, the experts' summed over
    # their edp group and divided by dp x cp (strategies/replicas.py).
    router_grad = layer.router.gate.weight.grad.clone()
    dist.all_reduce(router_grad)
    router_grad /= world_size
    experts = parallel.replica_classes(layer)
    grads_none = any(p.grad is None for p in layer.experts.parameters())
    expert_grads = {}
    for name, p in layer.experts.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(grad, group=experts[id(p)].group)
        divisor = dist.get_world_size(experts[id(p)].group) if trap == "mean_over_copies" else experts[id(p)].divisor
        expert_grads[name] = parallel.whole({f"experts.{name}": grad / divisor})[f"experts.{name}"]
    whole = x.clone().requires_grad_()
    reference.train()
    ref_out = reference(whole)
    (ref_out * dout).sum().div(world_size).add(reference.pop_aux() if balance == "aux_loss" else 0).backward()
    return {"output": (out - ref_out[rows]).abs().max().item(),
            "input": (mine.grad / world_size - whole.grad[rows]).abs().max().item(),
            "router": (router_grad - reference.router.gate.weight.grad).abs().max().item(),
            "experts": max((expert_grads[n] - p.grad).abs().max().item()
                           for n, p in reference.experts.named_parameters()),
            "chosen": torch.equal(layer.chosen, reference.chosen[rows]), "none": grads_none}


ROUTINGS = [("softmax", "aux_loss", None), ("sigmoid", "bias", None), ("softmax", "none", 1.0),
            ("sigmoid", "aux_loss", 1.25), ("sigmoid", "skewed", None)]
"""(router, balance, capacity factor). skewed: every token to two experts, so a rank's experts get no row (its
all-to-alls send and receive empty tensors) and another's get every one."""


def _every_routing(rank, world_size, ep):
    return {routing: _alone(rank, world_size, ep, *routing) for routing in ROUTINGS}


def _torch_parts(rank, world_size):
    """ep_impl=torch's exchange around grouped matmuls run in fp32 (torch._grouped_mm refuses float64)."""
    from ddp_lab.expert_parallel import torch_exchange

    grouped = torch_exchange.grouped_experts

    class Float32:
        def __init__(self, experts):
            self.w1, self.w2, self.w3 = (w.float() for w in (experts.w1, experts.w2, experts.w3))

    torch_exchange.grouped_experts = lambda x, counts, experts: grouped(x.float(), counts, Float32(experts)).to(
        x.dtype)
    return [_alone(rank, world_size, 2, *routing, impl="torch") for routing in (ROUTINGS[0], ROUTINGS[-1])]


def _every_trap(rank, world_size):
    return {trap: _alone(rank, world_size, 2, trap=trap) for trap in TRAPS}


@pytest.mark.parametrize(("world_size", "ep"), [(2, 2), (4, 2), (4, 4)])
def test_the_layer_alone_matches_one_process_in_float64(world_size, ep):
    """Every routing at once per layout: output, every gradient to 1e-12, the same experts chosen."""
    for rank, results in enumerate(run_ranks(_every_routing, world_size, ep)):
        for routing, errors in results.items():
            assert errors["chosen"] and not errors["none"], (rank, routing, errors)
            assert max(errors[k] for k in ("output", "input", "router", "experts")) < 1e-12, (rank, routing, errors)


def test_torchs_parts_match_one_process_in_float32_tolerance():
    """ep_impl=torch (torch._grouped_mm refuses float64): the same layer, its experts in fp32, within fp32's
    rounding; with the skewed routing too (grouped matmuls over experts with no rows)."""
    for errors in (e for per_rank in run_ranks(_torch_parts, 2) for e in per_rank):
        assert errors["chosen"] and not errors["none"], errors
        assert max(errors[k] for k in ("output", "input", "router", "experts")) < 1e-5, errors


TRAPS = {"detached_gates": "router", "per_rank_balance": "router", "scores_twice": "output",
         "wrong_inverse": "output", "no_autograd_exchange": "experts", "mean_over_copies": "experts"}
"""Each trap and the figure that shows it. mean_over_copies: the experts' gradients averaged over their copies alone
(divided by the edp group's size, as a strategy with one group would), ep times too large."""


def test_each_trap_fails_the_comparison_where_it_shows():
    """Each known bug, run through the same float64 comparison, differs by far more than 1e-12 on the figure that
    shows it; four of them (detached gates, no autograd through the exchange, a per-rank balancing loss, the
    experts averaged over their copies alone) leave the output exact, so only the gradients show them. Measured:
    the per-rank balancing loss moves the router's gradient by 7.9e-4 (a bf16 tolerance would pass it)."""
    results = run_ranks(_every_trap, 2)
    for trap, figure in TRAPS.items():
        worst = max(r[trap][figure] for r in results)
        assert worst > 1e-8, (trap, figure, [r[trap] for r in results])
    for trap in ("detached_gates", "no_autograd_exchange", "per_rank_balance", "mean_over_copies"):
        assert max(r[trap]["output"] for r in results) < 1e-12, trap
    assert all(r["no_autograd_exchange"]["none"] for r in results)  # no expert got a gradient at all


# --- training on every layout against one process, fp32 ------------------------------------------------------

def _frozen_expert():
    """The MoE Transformer with one expert tensor frozen (block 0's w3) and a shared expert."""
    model = traps.tiny_moe(shared_experts=1)()
    model.blocks[0].ffn.experts.w3.requires_grad_(False)
    return model


def _router_weights(parallel, wrapper, optimizer):
    """Every router's weights on this rank, to hold them identical on every rank after training."""
    def local(p):  # a DTensor (torch's replicate()) by this rank's copy
        return p.to_local() if hasattr(p, "to_local") else p
    return {n: local(p.detach()).clone() for n, p in wrapper.module.named_parameters() if ".router." in n}


def _scenarios(world_size: int) -> dict:
    """name -> (model factory, strategy, knobs, parallel keys by group), for one world size."""
    aux, bias = traps.tiny_moe(), traps.tiny_moe(router="sigmoid", balance="bias", bias_rate=0.01)
    out = {}
    if world_size == 2:
        ep = {"experts": {"ep": 2}}
        for strategy in ("naive", "flat", "overlap"):
            out[f"{strategy}-aux"] = (aux, strategy, {}, ep)
        out["bucketed-small-buckets"] = (aux, "bucketed", {"bucket_mb": 0.002}, ep)
        out["bucketed-bias"] = (bias, "bucketed", {}, ep)
        out["bucketed-capacity"] = (traps.tiny_moe(balance="none", capacity_factor=1.0), "bucketed", {}, ep)
        out["bucketed-frozen-shared"] = (_frozen_expert, "bucketed", {}, ep)
        out["torch-impl"] = (aux, "bucketed", {}, {"experts": {"ep": 2, "ep_impl": "torch"}})
        for strategy in EXACT:  # a mixture without expert parallelism: every exact strategy
            out[f"ep1-{strategy}"] = (aux, strategy, {}, {})
    else:
        out["ep2-dp4"] = (aux, "bucketed", {}, {"experts": {"ep": 2}})
        out["ep4"] = (bias, "flat", {}, {"experts": {"ep": 4}})
        out["cp2-ep4"] = (aux, "bucketed", {}, {"experts": {"ep": 4}, "context": {"cp": 2}})
        out["pp2-ep2"] = (bias, "bucketed", {}, {"experts": {"ep": 2}, "pipeline": {"pp": 2, "microbatches": 2}})
    return out


def _train_every_layout(rank, world_size):
    from ddp_lab.check.parity import train_on_mesh

    results = {}
    for name, (factory, strategy, knobs, keys) in _scenarios(world_size).items():
        results[name] = train_on_mesh(rank, world_size, factory, strategy, knobs=knobs, inspect=_router_weights,
                                      **keys)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_training_on_every_layout_matches_one_process(world_size):
    """Each scenario's weights on every rank (experts gathered whole) equal one process's to fp32 rounding, the
    selection bias included, and the live routers are identical on every rank of a stage (where a strategy keeps
    them whole)."""
    from ddp_lab.check.parity import assert_parity
    from ddp_lab.spec.strategies import SPECS

    results = run_ranks(_train_every_layout, world_size)
    for name, (_, strategy, _, _) in _scenarios(world_size).items():
        per_rank = [r[name] for r in results]
        try:
            assert_parity(per_rank)
        except AssertionError as error:
            raise AssertionError(f"{name} at {world_size} ranks: {error}") from None
        if SPECS[strategy].zero_stage == 3:
            continue  # each rank holds a shard of the router: the gathered weights above are the whole ones
        routers = [routers for _, _, routers in per_rank]
        for other in routers[1:]:
            for key in set(other) & set(routers[0]):
                assert torch.equal(other[key], routers[0][key]), (name, key)


# --- the all-to-all's bytes, counted as sent, against the formula -----------------------------------------------

def _even_bytes(rank, world_size, ep, impl):
    """One forward and backward under a routing made exactly even (token t of every rank to experts t mod 4 and
    t + 1 mod 4, 4 tokens a rank): this rank's tally of the all-to-alls, each part."""
    from ddp_lab.expert_parallel import ExpertParallel
    from ddp_lab.spec.parallel import MeshLayout

    parallel = ExpertParallel(MeshLayout(world_size, ep=ep), impl)
    layer = _layer("softmax", "none", None).float()
    with torch.no_grad():
        layer.router.gate.weight.zero_()
        layer.router.gate.weight[:, :E] = 10 * torch.eye(E)
    parallel.apply(layer)
    x = torch.zeros(4, D)
    for t in range(4):
        x[t, t % E] = x[t, (t + 1) % E] = 1.0
    x.requires_grad_()
    layer.train()
    out = layer(x)
    forward_s = parallel.tally.seconds
    out.sum().backward()
    return parallel.pop(), layer.figures["load"].tolist(), parallel.tally.seconds == 0 and forward_s > 0, \
        forward_s


@pytest.mark.parametrize(("world_size", "ep", "impl"), [(2, 2, "lab"), (4, 4, "lab"), (4, 2, "torch")])
def test_the_all_to_all_bytes_are_the_formulas(world_size, ep, impl):
    """Under an even load every rank sends 4·T·k·d·b·(P−1)/P bytes a layer (spec/experts.py's all_to_all_bytes),
    a quarter in each direction, counted as sent (a rank's rows for its own experts never leave it); the time inside
    the all-to-alls includes the backward's (torch's run inside autograd, timed by hooks around its node)."""
    from ddp_lab.spec.experts import all_to_all_bytes
    from ddp_lab.spec.figures import EP_BYTES, EP_EXCHANGE, EP_PARTS

    expected = all_to_all_bytes(tokens=4, top_k=K, d_model=D, element_bytes=4, ep=ep)
    for tally, load, popped, forward_s in run_ranks(_even_bytes, world_size, ep, impl):
        assert load == [2] * E  # the routing is even, as the formula assumes
        assert popped and tally[EP_EXCHANGE.key] > forward_s * 1e3  # the backward's exchanges are timed too
        assert tally[EP_BYTES.key] == expected, tally
        assert all(tally[part.key] == expected / 4 for part in EP_PARTS), tally
