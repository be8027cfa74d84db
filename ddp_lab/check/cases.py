"""The conformance cases: what each proves, and the function every rank runs for them.

Each case is the parity proof of parity.py on one of models.py's models: every rank builds the
model from a different seed, wraps it, trains 4 AdamW (or SGD) steps on its slice (4 sequences) of the same
global batches (the trainer's own `train_step` and data), and must end with the weights that single-process
training on the whole batch reaches from rank 0's initial weights, to float32 rounding.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

import torch

from ddp_lab.check.parity import full_state, train_distributed
from ddp_lab.units import MiB

SEQUENCES_PER_RANK = 4  # the global batch divides evenly at any world size, and into 2 micro-batches
BUCKET_KNOBS = ("bucket_mb", "bucket_size_mb", "bucket_cap_mb")  # what a bucketed wrapper calls its size


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # a models.MODELS name
    proves: str
    grad_accum_steps: int = 1
    needs: str | None = None  # "no_sync" or "bucket": skipped for a wrapper without it
    ranks_agree_only: tuple[str, ...] = ()  # parameters (name prefixes) held against rank 0's, not the reference
    sgd: bool = False  # plain SGD instead of AdamW


CASES = {case.name: case for case in (
    Case("plain", "transformer", "same weights as single-process training on the full batch, "
         "from a different init on every rank"),
    Case("sgd", "transformer", "the same with plain SGD, where a gradient's scale shows (AdamW hides most of it: "
         "a sum in place of the average moves its step very little)", sgd=True),
    Case("frozen", "frozen", "a frozen layer: broadcast at start, never reduced"),
    Case("tied", "tied", "one weight shared by two layers: reduced once"),
    Case("unused", "unused", "a parameter no forward uses: the step ends, and every rank keeps the same value",
         ranks_agree_only=("unused.",)),
    Case("accumulation", "transformer", "two micro-batches, the first under no_sync(), equal one batch",
         grad_accum_steps=2, needs="no_sync"),
    Case("bucket", "transformer", "a bucket smaller than the largest parameter (half its bytes)", needs="bucket"),
)}


def locate(target: str) -> type:
    """The class at a dotted path (`my_pkg.ddp.MyDDP`); ValueError saying what is wrong."""
    module_name, _, name = target.rpartition(".")
    if not module_name:
        raise ValueError(f"{target!r} is not a dotted path to a class (my_pkg.module.MyDDP)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from None
    cls = getattr(module, name, None)
    if not inspect.isclass(cls):
        raise ValueError(f"{module_name!r} has no class {name!r}")
    if not callable(getattr(cls, "finish_gradient_synchronization", None)):
        raise ValueError(f"{target} has no finish_gradient_synchronization(): the check calls it after backward, "
                         "as the trainer does (ddp_lab/strategies/base.py)")
    return cls


def bucket_knob(cls: type) -> str | None:
    parameters = inspect.signature(cls).parameters
    return next((knob for knob in BUCKET_KNOBS if knob in parameters), None)


def skip_reason(case: Case, cls: type) -> str | None:
    """Why `cls` cannot run `case`, or None."""
    if case.needs == "no_sync" and not callable(getattr(cls, "no_sync", None)):
        return f"{cls.__name__} has no no_sync()"
    if case.needs == "bucket" and bucket_knob(cls) is None:
        return f"{cls.__name__} takes no bucket size ({', '.join(BUCKET_KNOBS)})"
    return None


def run_cases(rank: int, world_size: int, target: str, kwargs: dict, names: list[str]) -> dict:
    """On every rank, per named case: this rank's weights right after wrapping, after training, and the
    reference's after training (on rank 0, else None)."""
    cls = locate(target)
    out = {}
    for name in names:
        case, started = CASES[name], {}

        def make(module, case=case, started=started):
            extra = dict(kwargs)
            if case.needs == "bucket":
                largest = max(p.numel() * p.element_size() for p in module.parameters())
                extra[bucket_knob(cls)] = largest / 2 / MiB
            wrapper = cls(module, **extra)
            started.update(full_state(wrapper))
            return wrapper

        optimizer = {"optimizer_cls": torch.optim.SGD, "opt_kwargs": {"lr": 0.1}} if case.sgd else {}
        state, reference = train_distributed(rank, world_size, make, case.model, grad_accum_steps=case.grad_accum_steps,
                                             batch_size=SEQUENCES_PER_RANK * world_size, **optimizer)
        out[name] = (started, state, reference)
    return out


def _differs(got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> str | None:
    if got.shape != expected.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    if not torch.allclose(got.float(), expected.float(), atol=atol, rtol=rtol):
        return f"max |difference| {(got.float() - expected.float()).abs().max().item():.3g}"
    return None


def first_difference(case: Case, per_rank: list, atol: float, rtol: float) -> str | None:
    """The first rank and parameter that differ, said in a line; None when every rank matches.

    First the weights right after wrapping, against rank 0's (the start-up broadcast: each rank began
    from its own seed); then the trained weights against the single-process reference (or, for
    `ranks_agree_only`, against rank 0's)."""
    start0, trained0, reference = per_rank[0]
    for rank, (start, _, _) in enumerate(per_rank):
        for name, expected in start0.items():
            how = _differs(start[name], expected, 0.0, 0.0) if name in start else "missing"
            if how:
                return f"rank {rank}, {name}: {how} from rank 0's right after wrapping (the start-up broadcast)"
    for rank, (_, state, _) in enumerate(per_rank):
        for name, expected in reference.items():
            against = "the single-process reference"
            if name.startswith(case.ranks_agree_only):
                expected, against = trained0[name], "rank 0"
            how = _differs(state[name], expected, atol, rtol) if name in state else "missing"
            if how:
                return f"rank {rank}, {name}: {how} from {against} (tolerance {atol:g} + {rtol:g} x |expected|)"
    return None
