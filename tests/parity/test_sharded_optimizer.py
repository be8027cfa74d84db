"""ShardedOptimizer and the zero1 strategy: the same weights as a plain optimizer, state really sharded.

Every multi-rank case runs inside two spawns (4 ranks, then 2: a spawn costs ~2 s per rank on
this 2-core box), built from the strategy YAMLs as the trainer builds them. Each scenario trains
one model with a sharded optimizer on per-rank slices of the global batch while rank 0 trains a
copy with the plain optimizer on the whole batch (ddp_lab/check/parity.py); the assertions then read the
returned weights, states and communication figures.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from omegaconf import OmegaConf

from ddp_lab.check.models import MODELS
from ddp_lab.check.parity import ATOL, GLOBAL_BATCH, RTOL, global_batch, loss_of
from ddp_lab.check.ranks import run_ranks
from ddp_lab.rank.memory import expected_zero_bytes, model_state_bytes
from ddp_lab.spec.strategies import SPECS, spec_of
from ddp_lab.strategies import ShardedOptimizer
from ddp_lab.strategies.zero1 import assign_owners

STEPS = 10
ADD_AT = 5      # the frozen layer is unfrozen and added as a new param group before this step
SAVE_AT = 7     # checkpoint scenario: state_dict() after this many steps, then a fresh optimizer resumes
OPTIMIZERS = {
    # optimizer class, constructor kwargs, the two initial groups' own settings, the late group's
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1},
              [{"betas": (0.9, 0.99)}, {"lr": 5e-3, "weight_decay": 0.0, "betas": (0.8, 0.95)}],
              {"lr": 2e-3, "weight_decay": 0.05}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9},
            [{}, {"lr": 0.02, "momentum": 0.5, "dampening": 0.1}],
            {"lr": 0.01, "nesterov": True}),
}


def strategy_cfg(name: str, **overrides) -> dict:
    """The strategy's spec with `overrides`, as the plain config node the ranks read."""
    return OmegaConf.to_container(OmegaConf.structured(SPECS[name](**overrides)), resolve=True, enum_to_str=True)


ZERO1 = strategy_cfg("zero1")  # as shipped: BucketedDDP, allreduce_broadcast
# BucketedDDP and torch DDP plan their buckets at construction, so a layer unfrozen later is never
# synchronized by them; the scenarios that add a group mid-training use FlatDDP.
ZERO1_AB = strategy_cfg("zero1", grad_sync="flat", comm="allreduce_broadcast")
ZERO1_RS = strategy_cfg("zero1", comm="reduce_scatter")
ZERO1_TORCH = strategy_cfg("zero1_torch")


# ----- what each rank runs ----------------------------------------------------------------------


def _groups(model, opt_name):
    """Two groups with different hyperparameters: the weight matrices, and the biases."""
    _, _, (first, second), _ = OPTIMIZERS[opt_name]
    params = [p for n, p in model.named_parameters() if not n.startswith("frozen.")]
    return [{"params": [p for p in params if p.dim() > 1], **first},
            {"params": [p for p in params if p.dim() <= 1], **second}]


def _late_group(model, opt_name):
    model.frozen.requires_grad_(True)
    return {"params": list(model.frozen.parameters()), **OPTIMIZERS[opt_name][3]}


def _train(rank, world_size, scenario):
    """One scenario on this rank: (final weights, rank 0's reference weights, extras)."""
    opt_cls, kwargs, _, _ = OPTIMIZERS[scenario["optimizer"]]
    model_name = scenario.get("model", "frozen")
    late = model_name == "frozen"
    torch.manual_seed(rank)  # different init per rank: the wrapper's broadcast must fix it
    ddp = spec_of(scenario["strategy"]).build(MODELS[model_name]())
    reference = copy.deepcopy(ddp.module) if rank == 0 else None
    if scenario.get("resume"):  # rank 0 seeds 0 in both runs: the reference is the same uninterrupted run
        ddp.module.load_state_dict(scenario["resume"]["weights"])

    def make(model, sharded):
        groups = _groups(model, scenario["optimizer"]) if late else model.parameters()
        if not sharded:
            return opt_cls(groups, **kwargs)
        opt = ddp.make_optimizer(opt_cls, groups, **kwargs)
        if scenario.get("collectives"):
            opt.collectives = scenario["collectives"]
        return opt

    optimizer = make(ddp.module, sharded=True)
    extras = {}
    if scenario.get("resume"):
        optimizer.add_param_group(_late_group(ddp.module, scenario["optimizer"]))
        optimizer.load_state_dict(scenario["resume"]["state_dict"])
    schedule = (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.2 * s))) \
        if scenario.get("scheduler") else (lambda opt: None)
    scheduler = schedule(optimizer)
    local = GLOBAL_BATCH // world_size
    for step in range(SAVE_AT if scenario.get("resume") else 0, STEPS):
        if late and step == ADD_AT and not scenario.get("resume"):
            optimizer.add_param_group(_late_group(ddp.module, scenario["optimizer"]))
        if scenario.get("save") and step == SAVE_AT:
            extras["state_dict"] = optimizer.state_dict()
            extras["state_dict_to_0"] = optimizer.state_dict(to=0)
            extras["weights"] = {k: v.clone() for k, v in ddp.module.state_dict().items()}
            fresh = make(ddp.module, sharded=True)
            fresh.add_param_group(_late_group(ddp.module, scenario["optimizer"]))
            fresh.load_state_dict(extras["state_dict"])
            optimizer = fresh
        optimizer.zero_grad(set_to_none=True)
        loss_of(ddp, global_batch(step)[rank * local:(rank + 1) * local]).backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        extras["comm"] = ddp.comm.pop()  # the last step's figures are kept
    extras["collectives"] = optimizer.collectives  # what ran the broadcasts / reduce-scatters
    if isinstance(optimizer, ShardedOptimizer):
        index = optimizer._global_index()
        extras["owned"] = {index[p]: sum(v.numel() * v.element_size() for v in s.values() if torch.is_tensor(v))
                           for p, s in optimizer.state.items()}
        extras["trainable"] = sorted(i for p, i in index.items() if p.requires_grad)
        extras["param_bytes"] = [p.numel() * p.element_size() for p in index]
        extras["memory"] = model_state_bytes(ddp, optimizer)
        extras["loads"] = list(optimizer.loads)
        optimizer.zero_grad()
        extras["grads_after_zero_grad"] = sum(p.grad is not None for p in ddp.parameters())
    if rank == 0:
        ref_opt = make(reference, sharded=False)
        ref_scheduler = schedule(ref_opt)
        for step in range(STEPS):
            if late and step == ADD_AT:
                ref_opt.add_param_group(_late_group(reference, scenario["optimizer"]))
            if scenario.get("save") and step == SAVE_AT:
                extras["reference_state_dict"] = copy.deepcopy(ref_opt.state_dict())
            ref_opt.zero_grad(set_to_none=True)
            loss_of(reference, global_batch(step)).backward()
            ref_opt.step()
            if ref_scheduler is not None:
                ref_scheduler.step()
    weights = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    return weights, (reference.state_dict() if reference is not None else None), extras


def _dominant(rank, world_size):
    """One tensor far larger than the rest: where does the optimizer state land?"""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"big": torch.nn.Embedding(512, 64),
                                 **{f"small{i}": torch.nn.Linear(16, 16) for i in range(12)}})
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return {"param_bytes": [p.numel() * p.element_size() for p in model.parameters()],
            "state_bytes": model_state_bytes(model, opt)["optimizer_state"]}


def _run_all(rank, world_size, scenarios):
    out = {name: _train(rank, world_size, scenario) for name, scenario in scenarios.items()}
    out["dominant"] = _dominant(rank, world_size)
    return out


def _scenarios(world_size, resume=None):
    s = {}
    for opt_name in OPTIMIZERS:
        s[f"{opt_name}-allreduce_broadcast"] = {"strategy": ZERO1_AB, "optimizer": opt_name}
        s[f"{opt_name}-reduce_scatter"] = {"strategy": ZERO1_RS, "optimizer": opt_name}
    s["adamw-reduce_scatter-native"] = {"strategy": ZERO1_RS, "optimizer": "adamw", "collectives": "native"}
    s["adamw-allreduce_broadcast-native"] = {"strategy": ZERO1_AB, "optimizer": "adamw", "collectives": "native"}
    s["transformer-scheduler"] = {"strategy": ZERO1_RS, "optimizer": "adamw", "model": "transformer", "scheduler": True}
    s["transformer-bucketed"] = {"strategy": ZERO1, "optimizer": "adamw", "model": "transformer"}
    s["zero1_torch"] = {"strategy": ZERO1_TORCH, "optimizer": "adamw", "model": "transformer"}
    if resume is None:
        s["checkpoint"] = {"strategy": ZERO1_AB, "optimizer": "adamw", "save": True}
    else:
        s["resume"] = {"strategy": ZERO1_RS, "optimizer": "adamw", "resume": resume}
    return s


@pytest.fixture(scope="module")
def four():
    return run_ranks(_run_all, 4, _scenarios(4))


@pytest.fixture(scope="module")
def two(four):
    """2 ranks; its `resume` scenario continues from the state_dict the 4-rank run saved."""
    saved = four[0]["checkpoint"][2]
    resume = {"weights": saved["weights"], "state_dict": saved["state_dict"]}
    return run_ranks(_run_all, 2, _scenarios(2, resume=resume))


def _assert_parity(results, name):
    reference = results[0][name][1]
    for rank, result in enumerate(results):
        for key, tensor in reference.items():
            torch.testing.assert_close(result[name][0][key], tensor, atol=ATOL, rtol=RTOL,
                                       msg=lambda m, k=key, r=rank: f"{name}, rank {r}, {k}: {m}")


SHARED = ["adamw-allreduce_broadcast", "adamw-reduce_scatter", "sgd-allreduce_broadcast", "sgd-reduce_scatter",
          "adamw-reduce_scatter-native", "adamw-allreduce_broadcast-native", "transformer-scheduler",
          "transformer-bucketed"]


# ----- the tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SHARED)
@pytest.mark.parametrize("world", ["four", "two"])
def test_same_weights_as_plain_optimizer(name, world, request):
    """Two groups with their own hyperparameters, a third added mid-training (frozen model), or an
    LR schedule (transformer): every rank ends with the plain optimizer's weights."""
    _assert_parity(request.getfixturevalue(world), name)


@pytest.mark.parametrize("world", ["four", "two"])
def test_comm_modes_agree(world, request):
    results = request.getfixturevalue(world)
    for opt_name in OPTIMIZERS:
        for key, tensor in results[0][f"{opt_name}-allreduce_broadcast"][0].items():
            for mode in ("reduce_scatter", "reduce_scatter-native") if opt_name == "adamw" else ("reduce_scatter",):
                torch.testing.assert_close(results[0][f"{opt_name}-{mode}"][0][key], tensor, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("world", ["four", "two"])
@pytest.mark.parametrize("name", SHARED)
def test_state_is_sharded(world, name, request):
    """Summed over ranks the state covers every trainable parameter exactly once, and the heaviest
    rank holds at most 1.1x the best whole-parameter split (its lower bound, which is <= best)."""
    results = request.getfixturevalue(world)
    owned = [r[name][2]["owned"] for r in results]
    assert sorted(i for o in owned for i in o) == results[0][name][2]["trainable"]  # each once, none missing
    state_bytes = [b for o in owned for b in o.values()]
    per_rank = [sum(o.values()) for o in owned]
    best_lower_bound = max(max(state_bytes), sum(state_bytes) / len(results))
    assert max(per_rank) <= 1.1 * best_lower_bound, per_rank
    for result, mine in zip(results, per_rank):
        assert result[name][2]["memory"]["optimizer_state"] == mine
        assert result[name][2]["grads_after_zero_grad"] == 0  # zero_grad covers every parameter


def test_dominant_tensor_sits_alone(four):
    """A 32K-float embedding beside twelve 272-float layers: the rank holding it holds nothing else."""
    sizes = four[0]["dominant"]["param_bytes"]
    per_rank = [r["dominant"]["state_bytes"] for r in four]
    adam_bytes = 2 * max(sizes) + 4  # m and v like the tensor, plus the scalar step
    assert max(per_rank) == adam_bytes
    assert sum(per_rank) == 2 * sum(sizes) + 4 * len(sizes)


def test_comm_bytes(four, two):
    """Payload and calls recorded per step: allreduce_broadcast = all-reduce G + broadcasts P; reduce_scatter
    = reduce-scatter G + all-gather P (the lab's rings, gloo's default: the owners' segments at their exact
    sizes; the backend's own, nccl's calls: N segments padded to the largest shard, N x max shard each)."""
    for results in (four, two):
        for name in ("adamw-allreduce_broadcast", "adamw-allreduce_broadcast-native", "adamw-reduce_scatter",
                     "adamw-reduce_scatter-native"):
            extras = results[0][name][2]
            trainable = sum(extras["param_bytes"][i] for i in extras["trainable"])
            comm = extras["comm"]
            if name == "adamw-reduce_scatter-native":  # every owner's segment padded to the largest shard
                assert comm["comm_bytes"] == 2 * len(results) * max(extras["loads"]), name
            else:
                assert comm["comm_bytes"] == 2 * trainable, name
            assert 0 < comm["exposed_optimizer_comm_ms"] < comm["exposed_comm_ms"]  # the step's share of the wait
            params = len(extras["trainable"])
            # flat all-reduce + one broadcast per parameter; one reduce-scatter + one all-gather either way
            assert comm["collectives"] == {"adamw-allreduce_broadcast": 1 + params,
                                           "adamw-allreduce_broadcast-native": 1 + params,
                                           "adamw-reduce_scatter": 2,
                                           "adamw-reduce_scatter-native": 2}[name], name


def test_zero1_torch_counts_its_broadcasts(four, two):
    """torch's ZeRO's post-step parameter broadcasts are in the comm figures, as ShardedOptimizer's are:
    both move G (gradient all-reduce) + P (every parameter broadcast once) on the same Transformer."""
    for results in (four, two):
        ours, theirs = (results[0][name][2]["comm"] for name in ("transformer-bucketed", "zero1_torch"))
        assert theirs["comm_bytes"] == ours["comm_bytes"]
        assert theirs["exposed_optimizer_comm_ms"] > 0  # the broadcasts' wait, inside its step()
        params = len(list(MODELS["transformer"]().parameters()))
        assert theirs["collectives"] > params  # DDP's buckets + one broadcast per parameter
        assert results[0]["zero1_torch"][2]["collectives"] == "ring"  # the lab's chain broadcasts on gloo


def test_state_dict_is_a_plain_optimizers(four):
    """The consolidated dict equals plain AdamW's after the same steps (same layout and values), on
    every rank, and state_dict(to=0) gives the same to rank 0 and None elsewhere."""
    expected = four[0]["checkpoint"][2]["reference_state_dict"]
    for rank, result in enumerate(four):
        extras = result["checkpoint"][2]
        for got in [extras["state_dict"]] + ([extras["state_dict_to_0"]] if rank == 0 else []):
            assert got["param_groups"] == expected["param_groups"]
            assert got["state"].keys() == expected["state"].keys()
            for i, entry in expected["state"].items():
                for key, value in entry.items():
                    torch.testing.assert_close(got["state"][i][key], value, atol=ATOL, rtol=RTOL)
        if rank != 0:
            assert extras["state_dict_to_0"] is None


def test_state_dict_round_trip(four, two):
    """Saved at step 7 on 4 ranks: a fresh optimizer on 4 ranks, one on 2 ranks (re-sharded by the
    2-rank owner map, other comm mode), and a plain AdamW all continue to the uninterrupted weights."""
    _assert_parity(four, "checkpoint")
    _assert_parity(two, "resume")
    saved = four[0]["checkpoint"][2]
    torch.manual_seed(0)
    model = MODELS["frozen"]()
    model.load_state_dict(saved["weights"])
    model.frozen.requires_grad_(True)
    opt_cls, kwargs, _, _ = OPTIMIZERS["adamw"]
    plain = opt_cls(_groups(model, "adamw")[:2] + [_late_group(model, "adamw")], **kwargs)
    plain.load_state_dict(saved["state_dict"])
    for step in range(SAVE_AT, STEPS):
        plain.zero_grad()
        loss_of(model, global_batch(step)).backward()
        plain.step()
    for key, tensor in four[0]["checkpoint"][1].items():
        torch.testing.assert_close(model.state_dict()[key], tensor, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("world", ["four", "two"])
def test_zero1_torch_reference_trains_the_same(world, request):
    """zero1_torch (torch DDP + ZeroRedundancyOptimizer) as shipped, beside ours."""
    _assert_parity(request.getfixturevalue(world), "zero1_torch")


# ----- single process ---------------------------------------------------------------------------


def _best_split(sizes, n):
    """The best whole-item split's heaviest load, by trying every assignment (small inputs only)."""
    best = sum(sizes)
    for owners in itertools.product(range(n), repeat=len(sizes) - 1):
        loads = [0] * n
        for size, owner in zip(sizes, (0,) + owners):  # item 0 on rank 0: the rest is symmetric
            loads[owner] += size
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("sizes, n", [
    ([3, 3, 2, 2, 2], 2),                          # LPT's worst case: greedy alone gives 7 vs 6
    ([5, 5, 4, 4, 3, 3, 3], 3),                    # and on three ranks: 11 vs 9
    ([1000, 10, 9, 8, 7, 6, 5, 4, 3, 2], 4),       # one dominant tensor
    ([64, 64, 64, 32, 32, 16, 8, 8, 4, 2], 3),
])
def test_owner_split_within_10pct_of_best(sizes, n):
    loads = [0] * n
    owners = assign_owners(sizes, n, loads)
    assert loads == [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(n)]
    assert max(loads) <= 1.1 * _best_split(sizes, n)


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_owner_split_of_small_transformer(n):
    """Table 1's small model (87 tensors): within 10% of total/N, a lower bound of the best split."""
    from ddp_lab.models import Transformer

    with torch.device("meta"):
        model = Transformer(vocab_size=10000, context_length=128, d_model=768, d_ff=3072, num_layers=12, num_heads=12)
    sizes = [p.numel() * 4 for p in model.parameters()]
    loads = [0] * n
    assign_owners(sizes, n, loads)
    assert max(loads) <= 1.1 * max(max(sizes), sum(sizes) / n)


def test_later_groups_balance_on_top_and_move_nothing():
    loads = [0, 0]
    first = assign_owners([8, 4], 2, loads)
    second = assign_owners([4, 2, 2], 2, loads)
    assert first == [0, 1] and second == [1, 0, 1] and loads == [10, 10]


def test_single_process_is_bit_exact_with_plain_optimizer():
    """No process group: one rank owns everything; same weights bit for bit, same state_dict; named
    parameters and a closure pass through as they do for the plain optimizer."""
    torch.manual_seed(0)
    a = MODELS["tied"]()
    b = copy.deepcopy(a)
    sharded = ShardedOptimizer(a.named_parameters(), torch.optim.AdamW, lr=1e-2)
    plain = torch.optim.AdamW(b.named_parameters(), lr=1e-2)
    for step in range(3):
        for model, opt in ((a, sharded), (b, plain)):
            def closure(model=model, opt=opt, step=step):
                opt.zero_grad()
                loss = loss_of(model, global_batch(step))
                loss.backward()
                return loss
            assert opt.step(closure) is not None
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert sharded.state_dict()["param_groups"] == plain.state_dict()["param_groups"]
    with pytest.raises(ValueError, match="unknown comm"):
        ShardedOptimizer(a.parameters(), torch.optim.AdamW, comm="allgather")


def test_model_state_bytes_counts_what_is_held():
    model = MODELS["tied"]()  # the tied weight is one parameter: counted once
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters())
    assert model_state_bytes(model, opt) == {"params": 4 * n, "grads": 0, "optimizer_state": 0}
    loss_of(model, global_batch(0)).backward()
    opt.step()
    params = len(list(model.parameters()))
    assert model_state_bytes(model, opt) == {"params": 4 * n, "grads": 4 * n, "optimizer_state": 8 * n + 4 * params}


def test_expected_zero_bytes_matches_the_paper():
    """ZeRO paper, figure 1: 7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12)."""
    psi, n = 7_500_000_000, 64

    def total(stage):
        return sum(expected_zero_bytes(psi, 2, n, stage).values()) / 1e9

    assert total(0) == pytest.approx(120)
    assert total(1) == pytest.approx(31.4, abs=0.05)
    assert total(2) == pytest.approx(16.6, abs=0.05)
    assert total(3) == pytest.approx(1.9, abs=0.05)
    assert expected_zero_bytes(1000, 4, 4, 1) == {"params": 4000, "grads": 4000, "optimizer_state": 2000}


def test_is_sharded():
    from ddp_lab.rank.memory import is_sharded

    params = list(MODELS["tied"]().parameters())
    assert is_sharded(ShardedOptimizer(params, torch.optim.AdamW))
    assert not is_sharded(torch.optim.AdamW(params))


def _non_contiguous(rank, world_size, comm):
    """A transposed (non-contiguous) weight: its update must still reach every rank."""
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(6, 4).t()), torch.nn.Parameter(torch.randn(4))]
    reference = [w.detach().clone() for w in weights]
    opt = ShardedOptimizer(weights, torch.optim.AdamW, comm=comm, lr=0.1)
    plain = torch.optim.AdamW([torch.nn.Parameter(w) for w in reference], lr=0.1)
    for step in range(3):
        for w, r in zip(weights, plain.param_groups[0]["params"]):
            w.grad = torch.full_like(w, step + 1.0)  # the same on every rank: the average is itself
            r.grad = torch.full_like(r, step + 1.0)
        opt.step()
        plain.step()
    return [w.detach().clone() for w in weights], [r.detach().clone() for r in plain.param_groups[0]["params"]]


@pytest.mark.parametrize("comm", ["allreduce_broadcast", "reduce_scatter"])
def test_non_contiguous_parameter(comm):
    for got, expected in run_ranks(_non_contiguous, 2, comm):
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)
