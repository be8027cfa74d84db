"""`measure.per_collective=false`: the stamps off change what is measured, never what is trained.

With the figures off, every strategy that stamps its collectives trains to the same weights as with them on
(bit for bit: the same collectives in the same order), counts the same collectives and bytes, and times none
(no interval, no comm_ms); torch_ddp is torch's DDP bare: no comm hook, no hook on any parameter, and no
collective it claims to have seen. And the lab's own per-step work, counted by torch's dispatcher, is no
more than torch's DDP does: no copy, allocation or host synchronization per step that torch_ddp does not
also make (the causes a GPU makes expensive: docs/benchmarks.md, "On one GPU").
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ddp_lab.check.models import tiny_transformer
from ddp_lab.rank.step import train_step
from ddp_lab.spec.strategies import spec_of
from ddp_lab.strategies.comm_stats import set_per_collective
from tests.helpers.distributed import rank_batch, ranks_fixture

STAMPED = ["naive", "overlap", "bucketed", "zero1", "zero2", "fsdp", "powersgd", "torch_ddp"]
STEPS = 3


def _train(name: str, on: bool, rank: int, world_size: int) -> dict:
    set_per_collective(on)
    try:
        torch.manual_seed(rank)  # different init per rank: the strategy's broadcast must fix it
        model = spec_of({"name": name}).build(tiny_transformer())
        optimizer = model.make_optimizer(torch.optim.AdamW, lr=1e-2)
        figures = []
        for step in range(STEPS):
            train_step(model, optimizer, [rank_batch(step, rank, world_size)])
            figures.append(model.comm.pop())
        hooked = sum(bool(getattr(p, "_post_accumulate_grad_hooks", None)) for p in model.module.parameters())
        return {"weights": {k: v.clone() for k, v in model.full_state_dict().items()}, "figures": figures,
                "hooked": hooked, "comm_hook": getattr(getattr(model, "ddp", None), "_comm_hooks", None)}
    finally:
        set_per_collective(True)


def _both(rank: int, world_size: int) -> dict:
    return {(name, on): _train(name, on, rank, world_size) for name in STAMPED for on in (True, False)}


results = ranks_fixture(_both, 2)


@pytest.mark.parametrize("name", STAMPED)
def test_figures_off_train_the_same_weights(results, name):
    for rank in results:
        on, off = rank[(name, True)]["weights"], rank[(name, False)]["weights"]
        for key in on:
            assert torch.equal(on[key], off[key]), (name, key)


@pytest.mark.parametrize("name", [n for n in STAMPED if n != "torch_ddp"])
def test_figures_off_count_the_collectives_and_time_none(results, name):
    on, off = results[0][(name, True)]["figures"], results[0][(name, False)]["figures"]
    for timed, counted in zip(on, off):
        assert counted["collectives"] == timed["collectives"] > 0, name
        assert counted["comm_bytes"] == timed["comm_bytes"], name
        assert "comm_ms" in timed and "comm_ms" not in counted, name


def test_torch_ddp_off_is_torchs_ddp_bare(results):
    on, off = results[0][("torch_ddp", True)], results[0][("torch_ddp", False)]
    assert on["hooked"] > 0 and on["comm_hook"], "the lab's torch_ddp hooks every parameter and DDP's buckets"
    assert off["hooked"] == 0, "bare: no hook on any parameter"
    assert not off["comm_hook"], "bare: no comm hook, DDP's own all-reduce"
    assert all("comm_ms" not in f and "collectives" not in f for f in off["figures"]), off["figures"]


# --- what the lab dispatches per step, beside torch's DDP ----------------------------------------

# Operations a GPU makes costly where a CPU does not notice: a copy of gradient bytes, an allocation the
# caching allocator must serve, and a read of a device value by the host (a synchronization).
COSTLY = {"copy": ("aten.copy_", "aten._to_copy", "aten.clone"),
          "allocation": ("aten.empty", "aten.zeros", "aten.new_empty", "aten.new_zeros", "aten.empty_like",
                         "aten.zeros_like", "aten.cat"),
          "host read": ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero")}
BUCKET_FAMILY = ["overlap", "bucketed", "zero2"]  # torch_ddp is their bar (zero1 and powersgd add an optimizer's
# or a compression's own work; their bucket path is bucketed's)


class _Costly(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        for kind, names in COSTLY.items():
            if name in names:
                self.counts[kind] += 1
        return func(*args, **(kwargs or {}))


class _Compared(TorchFunctionMode):
    """Tensors compared on the host (`==`, `!=`), each a Python call into torch: what a wrapper whose attribute
    shadows an nn.Module registry pays on every attribute it sets (`name in self._buffers` compares the name with
    each tensor of a list)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in ("__eq__", "__ne__")
        return func(*args, **(kwargs or {}))


REGISTRIES = ("_parameters", "_buffers", "_modules")


def _shadowed(model: torch.nn.Module) -> list[str]:
    """nn.Module registries that a module of `model` (the wrapper included) replaced with something not a dict."""
    return [f"{type(m).__name__}.{r}" for m in model.modules() for r in REGISTRIES
            if not isinstance(getattr(m, r), dict)]


def _dispatched(rank: int, world_size: int) -> dict:
    counts = {}
    for name in [*BUCKET_FAMILY, "torch_ddp"]:
        torch.manual_seed(0)
        model = spec_of({"name": name}).build(tiny_transformer())
        optimizer = model.make_optimizer(torch.optim.AdamW, lr=1e-2)
        for step in range(STEPS):  # the last step counted: buckets built, DDP's rebuilt
            mode = _Costly() if step == STEPS - 1 else None
            if mode is not None:
                with mode, _Compared() as compared:
                    train_step(model, optimizer, [rank_batch(step, rank, world_size)])
                counts[name] = {**mode.counts, "buckets": len(model.facts().get("buckets", {}).get("sizes_mb", [])),
                                "compared": compared.count, "shadowed": _shadowed(model)}
            else:
                train_step(model, optimizer, [rank_batch(step, rank, world_size)])
    return counts


dispatched = ranks_fixture(_dispatched, 1)


@pytest.mark.parametrize("name", BUCKET_FAMILY)
def test_the_bucket_path_costs_no_more_than_torchs_ddp(dispatched, name):
    """Per step: no more copies, allocations or host reads than torch's DDP on the same model (one rank: the
    collectives are copies of nothing, as on the GPU where the bucket path cost 3x torch's)."""
    ours, torch_ddp = dispatched[0][name], dispatched[0]["torch_ddp"]
    for kind in COSTLY:
        allowed = torch_ddp.get(kind, 0)
        if name == "zero2" and kind == "allocation":
            # ZeRO-2 by design: each bucket allocated at a step's first forward and freed after its sync (the
            # gradient memory it saves), one allocation per bucket, none per parameter
            allowed += ours["buckets"]
        assert ours.get(kind, 0) <= allowed, (name, kind, ours, torch_ddp)


@pytest.mark.parametrize("name", BUCKET_FAMILY)
def test_the_bucket_path_compares_no_tensor_on_the_host(dispatched, name):
    """The cause of the bucket path's 3x torch's DDP on the H200 (docs/measured/gpu.md, "The bucket path, found"):
    BucketedDDP kept its buckets in `self._buffers`, nn.Module's buffer registry, so every attribute set on the
    wrapper (one per bucket launched, in the hook on autograd's thread) looked its name up in the list of buckets,
    one host-side tensor comparison each (~12 us on this CPU; 75 buckets x 75 comparisons a step on medium). A step
    compares no tensor on the host, and every module keeps nn.Module's registries."""
    ours = dispatched[0][name]
    assert ours["compared"] == 0, ours
    assert ours["shadowed"] == [], ours
