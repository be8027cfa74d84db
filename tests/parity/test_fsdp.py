"""fsdp trains to the single-process weights, and its parameters, gradients and optimizer state really
are sharded.

One `run_ranks` call per world size: at 2 ranks every scenario plus the compute dtypes and the
checkpoint, at 3, 4 and 5 ranks (uneven rows: padding, and ranks holding no row of a parameter)
the tiny Transformer through both collective paths (gloo's per-row reduces, nccl's
reduce_scatter_single). Each scenario is the parity proof of ddp_lab/check/parity.py (different
init per rank, the trainer's train_step on the trainer's data) plus what the wrapper holds at the end.

Bit for bit at 2 ranks on embedding, linear and norm layers: the reference accumulates the two
ranks' slices as two micro-batches, each loss halved, which is the same arithmetic as halving each
rank's gradient and summing two values (tests/parity/test_zero2.py says why); AdamW is elementwise,
so updating row blocks equals updating whole tensors. At 3 or more ranks: float32 rounding.

Compute dtype (bf16, fp16): the reference casts every parameter to the dtype for each forward
(`torch.func.functional_call`), runs the ranks' slices as micro-batches and adds the low-precision
gradients into fp32 master gradients, as fsdp does; within 1e-4.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from ddp_lab.check.models import MODELS
from ddp_lab.check.parity import (
    STEPS,
    CastSingleProcess,
    assert_parity,
    assert_parity_each,
    per_scenario,
    train_distributed,
)
from ddp_lab.check.ranks import run_ranks
from ddp_lab.rank.memory import model_state_bytes
from ddp_lab.strategies import FSDP, TorchFSDP


class FSDPNative(FSDP):
    """gloo's own reduce_scatter_single / all_gather_single (backend.collectives=native: nccl's calls);
    FSDP itself runs the lab's rings, gloo's default."""

    collectives = "native"


def inspect(ddp, optimizer) -> dict | None:
    """What the wrapper holds after the last step, for the assertions below: fsdp's units and figures; fsdp_torch's
    gathered peak and each unit's gathered bytes."""
    if isinstance(ddp, TorchFSDP):
        return {"peak_gathered": ddp.peak_gathered_bytes, "torch_units": [g.gathered_bytes for _, g in ddp._gathers]}
    if not isinstance(ddp, FSDP):
        return None
    n = ddp.units[0].world_size
    units, gather_bytes, gather_calls, expected_bytes, expected_calls = [], 0, 0, 0, 0
    last = ddp._order[-1]
    for unit in ddp.units:
        kept = unit.module is None or unit is last or not ddp.reshard_after_forward or not unit.needed_in_backward
        gathers = 1 if kept else 2
        if unit.sharded:
            element = torch.empty((), dtype=unit.compute_dtype).element_size()
            gather_bytes += gathers * n * unit.flat.numel() * element
            gather_calls += gathers
        wire = torch.empty((), dtype=unit.wire_dtype or torch.float32).element_size()
        if unit.grad_numel:
            expected_bytes += wire * n * unit.grad_numel
            expected_calls += 1
        if unit.replicated_grad_numel:
            expected_bytes += wire * unit.replicated_grad_numel
            expected_calls += 1
        units.append({"gathered_bytes": unit.gathered_bytes,
                      "padded_elements": unit.flat.numel(),
                      "local_elements": sum(e.local.numel() for e in unit.sharded),
                      "replicated_bytes": sum(e.param.numel() * e.param.element_size() for e in unit.replicated),
                      "sharded": [(e.name, e.rows, min(ddp.units[0].rank * e.chunk, e.rows), e.local.shape[0])
                                  for e in unit.sharded]})
    return {"units": units, "comm": ddp.comm.pop(), "reduce_bytes": STEPS * expected_bytes,
            "reduce_calls": STEPS * expected_calls, "gather_bytes": STEPS * gather_bytes,
            "gather_calls": STEPS * gather_calls, "memory": model_state_bytes(ddp, optimizer),
            "peak_gathered": ddp.peak_gathered_bytes,
            "grads": {name: (tuple(p.shape), tuple(p.grad.shape), p.grad.dtype)
                      for name, p in ddp.module.named_parameters() if p.requires_grad},
            "replicated_grads": {e.name: e.param.grad.clone() for u in ddp.units for e in u.replicated
                                 if e.param.requires_grad},
            "local_bytes": sum(p.numel() * p.element_size() for p in ddp.parameters()),
            "full_bytes": sum(p.numel() * p.element_size() for p in ddp.gather_full_params().values()),
            "at_rest": all(not u.gathered and u.pending is None for u in ddp.units)}


TWO = {
    "exact": (FSDP, "norms", {"exact_reference": True}),
    "exact_native": (FSDPNative, "norms", {"exact_reference": True}),
    "transformer": (FSDP, "transformer", {}),
    "keep_gathered": (partial(FSDP, reshard_after_forward=False), "transformer", {}),
    "all_params": (partial(FSDP, policy="all_params"), "transformer", {}),
    "tied": (FSDP, "tied", {}),
    "own_classes": (FSDP, "own_classes", {}),
    "frozen": (FSDP, "frozen", {}),
    "accumulate": (FSDP, "transformer", {"grad_accum_steps": 2, "set_to_none": False}),
    "bf16": (partial(FSDP, compute_dtype=torch.bfloat16), "transformer",
             {"exact_reference": True, "reference_wrapper": partial(CastSingleProcess, dtype=torch.bfloat16)}),
    "fp16": (partial(FSDP, compute_dtype=torch.float16), "tied",
             {"exact_reference": True, "reference_wrapper": partial(CastSingleProcess, dtype=torch.float16)}),
    "bf16_wire": (partial(FSDP, comm_dtype="bf16"), "transformer",  # SGD: an update proportional to the gradient
                  {"optimizer_cls": torch.optim.SGD, "opt_kwargs": {"lr": 0.1}}),
    "torch": (TorchFSDP, "transformer", {}),
    "torch_accumulate": (TorchFSDP, "transformer", {"grad_accum_steps": 2}),
    "torch_keep_gathered": (partial(TorchFSDP, reshard_after_forward=False), "transformer", {}),
    "torch_bf16": (partial(TorchFSDP, compute_dtype=torch.bfloat16), "transformer",
                   {"exact_reference": True, "reference_wrapper": partial(CastSingleProcess, dtype=torch.bfloat16)}),
}
EXACT = ("exact", "exact_native")
LOW = ("bf16", "fp16", "torch_bf16")
WIRE = ("bf16_wire",)  # gradients summed in bf16 against an fp32 reference: their bf16 rounding, times lr
ALL_MANY = {"transformer": (FSDP, "transformer", {}), "transformer_native": (FSDPNative, "transformer", {})}
MANY_AT = {3: ("transformer", "transformer_native"), 4: ("transformer",), 5: ("transformer_native",)}


def _checkpoint(rank, world_size, saved=None):
    """Train a little and return the consolidated checkpoint; or load `saved` (from another world
    size) and return what this world size gathers from it."""
    torch.manual_seed(rank)
    ddp = FSDP(MODELS["tied"]())
    if saved is None:
        optimizer = ddp.make_optimizer(torch.optim.AdamW, lr=1e-2)
        ddp(torch.randint(0, 64, (2, 8))).float().pow(2).mean().backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
        return {"state": ddp.full_state_dict(), "full": ddp.gather_full_params()}
    ddp.load_full_state_dict(saved)
    return {"state": ddp.full_state_dict(), "full": ddp.gather_full_params()}


def _run(rank, world_size, scenarios, saved=None):
    batch = 2 * world_size  # any world size divides it
    out = {name: train_distributed(rank, world_size, make, model, batch_size=batch, inspect=inspect, **kwargs)
           for name, (make, model, kwargs) in scenarios.items()}
    out["checkpoint"] = _checkpoint(rank, world_size, saved)
    return out


@pytest.fixture(scope="module")
def two():
    return run_ranks(_run, 2, TWO)


@pytest.fixture(scope="module", params=[3, 4, 5], ids=["3ranks", "4ranks", "5ranks"])
def many(request, two):
    scenarios = {name: ALL_MANY[name] for name in MANY_AT[request.param]}
    return run_ranks(_run, request.param, scenarios, two[0]["checkpoint"]["state"])


def _scenarios(results, names):
    """The fsdp scenarios (those whose units `inspect` looked into)."""
    for name, per_rank in per_scenario(results, names):
        if per_rank[0][-1] is not None and "units" in per_rank[0][-1]:
            yield name, per_rank


@pytest.mark.parametrize("name", list(TWO))
def test_same_weights_as_single_process_at_2_ranks(two, name):
    per_rank = [r[name] for r in two]
    if name in LOW or name in WIRE:
        reference = per_rank[0][1]
        for rank, (state, *_) in enumerate(per_rank):
            for key, tensor in reference.items():
                torch.testing.assert_close(state[key], tensor, atol=1e-4 if name in LOW else 1e-3, rtol=0,
                                           msg=lambda m, k=key, r=rank: f"rank {r}, {k}: {m}")
    else:
        assert_parity(per_rank, exact=name in EXACT)


def test_transformer_at_3_4_5_ranks(many):
    assert_parity_each(many, ALL_MANY)


def _assert_sharded(name, per_rank):
    """Summed over ranks the local rows cover every row of every sharded parameter exactly once; no
    rank holds more than its padded 1/N; the memory accounting counts exactly the local shards, their
    fp32 gradients and AdamW state; nothing is left gathered; the peak gathered is at most two units
    (plus the root, gathered for the whole step)."""
    n = len(per_rank)
    extras = [r[2] for r in per_rank]
    for u, unit in enumerate(extras[0]["units"]):
        for i, (pname, rows, *_) in enumerate(unit["sharded"]):
            pieces = sorted((e["units"][u]["sharded"][i][2], e["units"][u]["sharded"][i][3]) for e in extras)
            covered = 0
            for start, count in pieces:
                assert count == 0 or start == covered, f"{name}: {pname}: {pieces}"
                covered += count
            assert covered == rows, f"{name}: {pname} covered {covered} of {rows}"
    for rank, e in enumerate(extras):
        assert e["at_rest"], (name, rank)
        for unit in e["units"]:
            assert unit["local_elements"] <= unit["padded_elements"], (name, rank)
        assert e["local_bytes"] == sum(4 * u["local_elements"] + u["replicated_bytes"] for u in e["units"])
        assert e["memory"]["params"] == e["local_bytes"], (name, rank)
        assert e["local_bytes"] < e["full_bytes"] or n == 1, (name, rank)
        sizes = sorted((u["gathered_bytes"] for u in e["units"]), reverse=True)
        if name != "keep_gathered":  # reshard_after_forward=False holds every unit until the backward
            assert 0 < e["peak_gathered"] <= sum(sizes[:3]), (name, rank)
        if name.startswith("transformer"):  # prefetch: the next unit's gather is in flight beside this one
            assert e["peak_gathered"] > sizes[0], (name, rank, e["peak_gathered"], sizes)
        assert e["peak_gathered"] <= sum(sizes), (name, rank)
        for pname, (shape, grad_shape, dtype) in e["grads"].items():
            assert grad_shape == shape and dtype == torch.float32, (name, rank, pname)


def test_state_is_sharded(two, many):
    for results, names in ((two, TWO), (many, ALL_MANY)):
        for name, per_rank in _scenarios(results, names):
            _assert_sharded(name, per_rank)


def test_fsdp_torch_records_the_most_it_held_gathered(two):
    """As fsdp's `peak_gathered_bytes`: resharding after forward, the unit computing and the next one prefetched,
    never every unit at once; keeping them gathered (as under a pipeline), every unit at the end of the forward."""
    for rank, r in enumerate(two):
        resharded, kept = r["torch"][-1], r["torch_keep_gathered"][-1]
        sizes = sorted(resharded["torch_units"], reverse=True)
        assert len(sizes) >= 4 and kept["torch_units"] == resharded["torch_units"], (rank, sizes)
        assert sizes[0] < resharded["peak_gathered"] < sum(sizes), (rank, resharded["peak_gathered"], sizes)
        assert kept["peak_gathered"] == sum(sizes), (rank, kept["peak_gathered"], sizes)


def test_replicated_gradients_are_identical_on_every_rank(two, many):
    for results, names in ((two, TWO), (many, ALL_MANY)):
        for name, per_rank in _scenarios(results, names):
            first = per_rank[0][2]["replicated_grads"]
            for rank, r in enumerate(per_rank[1:], 1):
                for key, grad in first.items():
                    assert torch.equal(r[2]["replicated_grads"][key], grad), (name, rank, key)


def test_comm_bytes_and_calls(two, many):
    """Per micro-batch each unit is gathered twice (reshard_after_forward), once for the last unit of the
    forward, the root, an embedding (not needed in backward) or without resharding (gloo: one broadcast
    per rank row); per step its
    trainable padded gradients are reduced once (gloo: one reduce per rank row) and its replicated
    gradients all-reduced once."""
    for results, names in ((two, TWO), (many, ALL_MANY)):
        for name, per_rank in _scenarios(results, names):
            micro_batches = names[name][2].get("grad_accum_steps", 1)
            for rank, (*_, e) in enumerate(per_rank):
                assert e["comm"]["comm_bytes"] == micro_batches * e["gather_bytes"] + e["reduce_bytes"], (name, rank)
                assert e["comm"]["collectives"] == micro_batches * e["gather_calls"] + e["reduce_calls"], (name, rank)


def test_checkpoint_round_trips_onto_another_world_size(two, many):
    saved = two[0]["checkpoint"]["state"]
    for rank, r in enumerate(two):
        for key, tensor in saved.items():
            assert torch.equal(r["checkpoint"]["state"][key], tensor), (rank, key)
    plain = MODELS["tied"]()
    plain.load_state_dict(saved)  # a plain model loads it
    for rank, r in enumerate(many):
        for key, tensor in saved.items():
            assert torch.equal(r["checkpoint"]["state"][key], tensor), (len(many), rank, key)
        for key, tensor in plain.named_parameters():
            assert torch.equal(r["checkpoint"]["full"][key], tensor.detach()), (len(many), rank, key)
