"""local_sgd: data parallelism's weights at sync_every=1 with SGD; drift and exact agreement at
sync_every=4; DiLoCo's outer Nesterov step and buffer averaging against a hand computation.

- sync_every=1, SGD with momentum: the mean of the ranks' updates is the update of the mean
  gradient (SGD is linear in it), so every rank ends with the single-process weights (frozen, tied,
  Transformer; 2 and 3 ranks).
- sync_every=4, AdamW, the Transformer: after steps 1-3 and 5-7 the ranks' weights differ; after
  steps 4 and 8 they are bit-identical; comm_bytes is the model's bytes on those steps, 0 elsewhere.
- outer=nesterov: known gradients G_k (SGD lr 1, so a rank's weights are w - sum of its G_k), two
  syncs of two steps each, checked against Δ = θ - mean, b = μ b + Δ, θ -= lr (Δ + μ b) by hand;
  a persistent buffer set differently per rank is averaged at each sync, a non-persistent one is
  left alone.
"""

import torch
from torch import nn

from ddp_lab.check.models import MODELS
from ddp_lab.check.parity import assert_parity, data_cfg, train_distributed
from ddp_lab.check.ranks import run_ranks
from ddp_lab.rank.data import BatchSource
from ddp_lab.rank.step import train_step
from ddp_lab.strategies import LocalSGD
from ddp_lab.strategies.local_sgd import OUTER_LR, OUTER_MOMENTUM
from tests.helpers.distributed import ranks_fixture

SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}


def every_step(module):
    return LocalSGD(module, sync_every=1)


def _run(rank, world_size, models):
    """Every scenario in one set of rank processes: parity per model, and at 2 ranks the others."""
    parity = {name: train_distributed(rank, world_size, every_step, name, batch_size=2 * world_size,
                                      optimizer_cls=torch.optim.SGD, opt_kwargs=SGD) for name in models}
    others = {"every_4": _every_4(rank, world_size), "outer": _outer(rank, world_size)} if world_size == 2 else {}
    return {**parity, **others}


two = ranks_fixture(_run, 2, ("frozen", "tied", "transformer"))


def test_sync_every_step_with_sgd_is_data_parallelism(two):
    for name in ("frozen", "tied", "transformer"):
        assert_parity([r[name] for r in two])


def test_sync_every_step_at_an_odd_world_size():
    results = run_ranks(_run, 3, ("tied",))
    assert_parity([r["tied"] for r in results])


def _every_4(rank, world_size):
    torch.manual_seed(rank)
    wrapper = LocalSGD(MODELS["transformer"](), sync_every=4)
    optimizer = wrapper.make_optimizer(torch.optim.AdamW, lr=1e-2)
    batches = BatchSource(data_cfg(batch_size=2 * world_size), rank, world_size, torch.device("cpu"))
    weights, comm = [], []
    for step in range(8):
        train_step(wrapper, optimizer, list(batches.micro_batches(step)))
        weights.append(torch.cat([p.detach().reshape(-1) for p in wrapper.parameters()]).clone())
        comm.append(wrapper.comm.pop())
    return weights, comm, wrapper.facts()


def test_ranks_drift_between_syncs_and_agree_exactly_after_each(two):
    (weights0, comm, facts), (weights1, *_) = two[0]["every_4"], two[1]["every_4"]
    model_bytes = sum(p.numel() * 4 for p in MODELS["transformer"]().parameters())
    assert facts["local_sgd"]["bytes_per_sync"] == model_bytes
    for step, (a, b) in enumerate(zip(weights0, weights1)):
        if step in (3, 7):
            assert torch.equal(a, b), f"step {step}: ranks differ after a sync"
            assert comm[step]["comm_bytes"] == model_bytes and comm[step]["collectives"] == 1
        else:
            assert not torch.allclose(a, b), f"step {step}: ranks agree between syncs"
            assert comm[step]["comm_bytes"] == 0 and comm[step]["collectives"] == 0
    assert not torch.equal(weights0[3], weights0[7])  # it trains


class Tracked(nn.Module):
    """A weight trained by hand-made gradients, a running statistic, and a computed table."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.arange(6, dtype=torch.float32).view(2, 3))
        self.register_buffer("running", torch.zeros(3))
        self.register_buffer("table", torch.zeros(3), persistent=False)


def hand_grad(step: int, rank: int) -> torch.Tensor:
    return torch.randn(2, 3, generator=torch.Generator().manual_seed(10 * step + rank))


def _outer(rank, world_size):
    model = Tracked()
    wrapper = LocalSGD(model, sync_every=2, outer="nesterov")
    optimizer = wrapper.make_optimizer(torch.optim.SGD, lr=1.0)
    seen = []
    for step in range(4):
        model.running.fill_(float(rank + step))
        model.table.fill_(float(rank))
        model.weight.grad = hand_grad(step, rank)
        optimizer.step()
        seen.append({"weight": model.weight.detach().clone(), "running": model.running.clone(),
                     "table": model.table.clone()})
    return seen


def test_outer_nesterov_matches_a_hand_computation(two):
    world_size, mu, lr = 2, OUTER_MOMENTUM, OUTER_LR
    assert (lr, mu) == (0.7, 0.9)  # DiLoCo's
    theta = torch.arange(6, dtype=torch.float64).view(2, 3)
    local = [theta.clone() for _ in range(world_size)]
    momentum = None
    for step in range(4):
        local = [w - hand_grad(step, k).double() for k, w in enumerate(local)]
        if step % 2 == 1:
            delta = theta - sum(local) / world_size
            momentum = delta if momentum is None else mu * momentum + delta
            theta = theta - lr * (delta + mu * momentum)
            local = [theta.clone() for _ in range(world_size)]
            running = sum(float(k + step) for k in range(world_size)) / world_size
        for k in range(world_size):
            got = two[k]["outer"][step]
            torch.testing.assert_close(got["weight"].double(), local[k], atol=1e-5, rtol=1e-5,
                                       msg=lambda m, s=step, r=k: f"step {s}, rank {r}: {m}")
            assert torch.equal(got["table"], torch.full((3,), float(k)))  # not persistent: not averaged
            expected_running = running if step % 2 == 1 else float(k + step)
            assert torch.equal(got["running"], torch.full((3,), expected_running))
    # the outer step is not plain averaging
    plain = sum(torch.arange(6, dtype=torch.float64).view(2, 3) - hand_grad(0, k).double() - hand_grad(1, k).double()
                for k in range(world_size)) / world_size
    assert not torch.allclose(two[0]["outer"][1]["weight"].double(), plain, atol=1e-3)


# --- streaming DiLoCo: fragments, the delayed outer step, mix ---------------------------------------------------

class TwoTensors(nn.Module):
    """Two weights (24 and 12 bytes: fragments [a] and [b] when cut in two) and a running statistic."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.arange(6, dtype=torch.float32).view(2, 3))
        self.b = nn.Parameter(torch.arange(3, dtype=torch.float32))
        self.register_buffer("running", torch.zeros(3))


STREAMING = {  # name -> LocalSGD's knobs; each run 9 steps of hand gradients with SGD lr 1
    "fragments": {"sync_every": 4, "fragments": 2, "outer": "nesterov"},
    "delay": {"sync_every": 4, "delay": 1},
    "delay_mix": {"sync_every": 4, "fragments": 2, "delay": 1, "mix": 0.5, "outer": "nesterov"},
}


def hand_run(rank, configs: dict, make, model_cls, steps: int, seen=lambda model, wrapper: {}) -> dict:
    """{name: (each step's weights a, b, `seen(model, wrapper)` and comm figures; the wrapper's facts)} of
    `make(model_cls(), **knobs)` per config, trained by hand gradients with SGD lr 1 (the running statistic,
    where the model has one, set per rank and step); a wrapper with `close()` is closed after its config."""
    out = {}
    for name, knobs in configs.items():
        model = model_cls()
        wrapper = make(model, **knobs)
        optimizer = wrapper.make_optimizer(torch.optim.SGD, lr=1.0)
        steps_seen = []
        for step in range(steps):
            if hasattr(model, "running"):
                model.running.fill_(float(rank + step))
            model.a.grad, model.b.grad = hand_grad(step, rank), hand_grad(step, rank)[0]
            optimizer.step()
            steps_seen.append({"a": model.a.detach().clone(), "b": model.b.detach().clone(), **seen(model, wrapper),
                               **wrapper.comm.pop()})
        out[name] = steps_seen, wrapper.facts()
        if hasattr(wrapper, "close"):  # torchft's: its manager and Lighthouse stopped before the next scenario's
            wrapper.close()
    return out


def _streaming(rank, world_size):
    return hand_run(rank, STREAMING, LocalSGD, TwoTensors, 9, lambda model, _: {"running": model.running.clone()})

streaming = ranks_fixture(_streaming, 2)


def _by_hand(knobs: dict, world_size: int = 2) -> list[list[dict]]:
    """The rule of strategies/local_sgd.py in float64, tensor by tensor: fragment 0 = [a] syncs when
    t % H == (1·H/F) % H, fragment 1 = [b] (and the buffer) when t % H == 0; a delayed sync is launched τ steps
    before and lands then on the average taken at launch; the outer step per fragment; mix keeps part of this
    rank's own."""
    H, F, tau, mix = knobs["sync_every"], knobs.get("fragments", 1), knobs.get("delay", 0), knobs.get("mix", 0.0)
    nesterov = knobs.get("outer") == "nesterov"
    fragments = [["a"], ["b"]] if F == 2 else [["a", "b"]]
    phase = [(f + 1) * H // F % H for f in range(F)]
    local = [{"a": torch.arange(6, dtype=torch.float64).view(2, 3), "b": torch.arange(3, dtype=torch.float64)}
             for _ in range(world_size)]
    anchor = [{k: local[0][k].clone() for k in frag} for frag in fragments]
    momentum = [dict() for _ in fragments]
    pending, history = [], []
    for step in range(9):
        t = step + 1
        for k, w in enumerate(local):
            w["a"] = w["a"] - hand_grad(step, k).double()
            w["b"] = w["b"] - hand_grad(step, k)[0].double()
        landed = [p for p in pending if p[0] == t]
        pending = [p for p in pending if p[0] != t]
        launched = [(t + tau, f, {n: sum(w[n] for w in local) / world_size for n in fragments[f]})
                    for f in range(F) if t % H == (phase[f] - tau) % H]
        if tau == 0:
            landed, launched = launched, []
        pending += launched
        for _, f, mean in landed:
            for n in fragments[f]:
                if nesterov:
                    delta = anchor[f][n] - mean[n]
                    momentum[f][n] = delta if n not in momentum[f] else OUTER_MOMENTUM * momentum[f][n] + delta
                    anchor[f][n] = anchor[f][n] - OUTER_LR * (delta + OUTER_MOMENTUM * momentum[f][n])
                    target = anchor[f][n]
                else:
                    target = mean[n]
                for w in local:
                    w[n] = mix * w[n] + (1 - mix) * target
        history.append([{n: w[n].clone() for n in ("a", "b")} for w in local])
    return history


def test_fragments_delay_and_mix_match_a_hand_computation(streaming):
    for name, knobs in STREAMING.items():
        expected = _by_hand(knobs)
        for step in range(9):
            for rank in range(2):
                got = streaming[rank][name][0][step]
                for n in ("a", "b"):
                    torch.testing.assert_close(
                        got[n].double(), expected[step][rank][n], atol=1e-5, rtol=1e-5,
                        msg=lambda m, s=step, r=rank, n=n, c=name: f"{c} step {s + 1} rank {r} {n}: {m}")


def test_fragments_sync_in_turn_and_the_peak_is_one_fragment(streaming):
    (seen0, facts), (seen1, _) = streaming[0]["fragments"], streaming[1]["fragments"]
    assert facts["local_sgd"]["fragment_bytes"] == [24, 24]  # [a]; [b] and the running statistic
    assert facts["local_sgd"]["peak_bytes_per_step"] == 24 and facts["local_sgd"]["bytes_per_sync"] == 48
    for step, (r0, r1) in enumerate(zip(seen0, seen1)):
        t = step + 1
        assert torch.equal(r0["a"], r1["a"]) == (t % 4 == 2), f"a at step {t}"
        assert torch.equal(r0["b"], r1["b"]) == (t % 4 == 0), f"b at step {t}"
        assert r0["comm_bytes"] == (24 if t % 2 == 0 else 0)
        assert torch.equal(r0["running"], torch.full((3,), 0.5 + step)) == (t % 4 == 0)


def test_a_delayed_sync_is_launched_early_and_its_bytes_count_at_launch(streaming):
    (seen0, _), (seen1, _) = streaming[0]["delay"], streaming[1]["delay"]
    for step, (r0, r1) in enumerate(zip(seen0, seen1)):
        t = step + 1
        assert torch.equal(r0["a"], r1["a"]) == (t % 4 == 0), f"step {t}: equal only where a sync landed"
        launched = t % 4 == 3  # one step before the sync step
        assert r0["comm_bytes"] == (48 if launched else 0) and r0["collectives"] == (1 if launched else 0)
    (mixed0, _), (mixed1, _) = streaming[0]["delay_mix"], streaming[1]["delay_mix"]
    assert not torch.equal(mixed0[4]["b"], mixed1[4]["b"])  # mix 0.5 keeps part of each rank's own


# --- SparseLoCo: the compressed outer step ----------------------------------------------------------------------

class TwoWeights(TwoTensors):
    """TwoTensors without the running statistic (SparseLoCo refuses models that have one)."""

    def __init__(self):
        super().__init__()
        del self.running


SPARSE = {  # name -> LocalSGD's knobs
    "every_value": {"sync_every": 4, "fragments": 2, "outer_topk": 4, "outer_chunk": 2, "outer_bits": 32},
    "compressed": {"sync_every": 2, "outer_topk": 1, "outer_chunk": 2, "outer_bits": 2, "error_decay": 0.5},
}


def _sparse(rank, world_size):
    return hand_run(rank, SPARSE, LocalSGD, TwoWeights, 8,
                    lambda _, wrapper: {"error": [e.clone() for s in wrapper._sparse for e in s.error]})

sparse = ranks_fixture(_sparse, 2)


def test_sparseloco_sending_every_value_is_plain_averaging(sparse):
    """outer_topk = every value of a block, unquantized: nothing stays behind, the anchor becomes the rank mean."""
    knobs = {k: v for k, v in SPARSE["every_value"].items() if not k.startswith("outer_")}
    expected = _by_hand(knobs)
    for step in range(8):
        for rank in range(2):
            got = sparse[rank]["every_value"][0][step]
            for n in ("a", "b"):
                torch.testing.assert_close(got[n].double(), expected[step][rank][n], atol=1e-5, rtol=1e-5)
            assert all(float(e.abs().max()) == 0.0 for e in got["error"])


def test_sparseloco_compressed_agrees_after_each_sync_and_keeps_the_rest(sparse):
    (seen0, facts), (seen1, _) = sparse[0]["compressed"], sparse[1]["compressed"]
    plan = facts["local_sgd"]
    # a (2 x 3): sides 2 and 1, 3 blocks of 2; b (3): 3 blocks of 1; k = 1: 6 scales, 6 int16 indices, 2 bytes of codes
    assert plan["outer_bytes_sent_per_sync"] == 6 * 4 + 6 * 2 + 2
    assert plan["fragment_bytes"] == [2 * plan["outer_bytes_sent_per_sync"]]  # the all-gather's output
    for step, (r0, r1) in enumerate(zip(seen0, seen1)):
        synced = (step + 1) % 2 == 0
        assert torch.equal(r0["a"], r1["a"]) == synced and torch.equal(r0["b"], r1["b"]) == synced, step
        assert r0["comm_bytes"] == (plan["fragment_bytes"][0] if synced else 0)
    assert any(float(e.abs().max()) > 0 for e in seen0[-1]["error"])  # what was not sent waits


def test_sparse_payload_parts_round_trip():
    from ddp_lab.strategies.sparse_outer import SparseOuter, dequantize, pack, quantize, unpack

    codes = torch.tensor([0, 1, 2, 3, 3, 2, 1], dtype=torch.uint8)
    assert torch.equal(unpack(pack(codes), 7), codes)
    values = torch.tensor([[-2.0, -0.6, 0.7, 2.0]])
    code, scale, stands_for = quantize(values)
    assert code.tolist() == [[0, 1, 2, 3]] and scale.tolist() == [2.0]
    torch.testing.assert_close(stands_for, torch.tensor([[-2.0, -2 / 3, 2 / 3, 2.0]]))
    torch.testing.assert_close(dequantize(code, scale), stands_for)
    # error feedback: what is sent plus what stays is decay x what stayed + Δ, value for value
    torch.manual_seed(0)
    outer = SparseOuter([torch.zeros(4, 6)], chunk=2, topk=1, bits=2, decay=0.5)
    outer.error[0].copy_(torch.randn(4, 6))
    before, delta = outer.error[0].clone(), torch.randn(4, 6)
    payload = outer.encode([delta])
    assert payload.numel() == outer.payload_bytes
    sent = outer.decode(torch.stack([payload, payload]))[0]  # two identical ranks: their mean is one's
    torch.testing.assert_close(sent + outer.error[0], 0.5 * before + delta)
