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
from functools import partial
from pathlib import Path

import torch

from ddp_lab.check.models import use_layers
from ddp_lab.check.observe import Observer, layers, unmeasured
from ddp_lab.check.parity import CastSingleProcess, full_state, ties_of, train_distributed
from ddp_lab.units import MiB

SEQUENCES_PER_RANK = 4  # the global batch divides evenly at any world size, and into 2 micro-batches
BUCKET_KNOBS = ("bucket_mb", "bucket_size_mb", "bucket_cap_mb")  # what a bucketed wrapper calls its size


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # a models.MODELS name
    proves: str
    grad_accum_steps: int = 1
    needs: str | None = None  # "no_sync" or "optimizer" (a target that is one): skipped without it
    sgd: bool = False  # plain SGD instead of AdamW
    groups: bool = False  # the optimizer over two param groups with options of their own (parity.two_groups)


CASES = {case.name: case for case in (
    Case("plain", "transformer", "same weights as single-process training on the full batch, "
         "from a different init on every rank"),
    Case("sgd", "transformer", "the same with plain SGD, where a gradient's scale shows (AdamW hides most of it: "
         "a sum in place of the average moves its step very little)", sgd=True),
    Case("own_classes", "own_classes", "a model of the user's own layer classes (a Linear, an Embedding, an "
         "RMSNorm that are not torch's), as the course's are: what a wrapper keyed on torch's classes misses"),
    Case("frozen", "frozen", "a frozen layer: broadcast at start, never reduced"),
    Case("tied", "tied", "one weight shared by two layers: reduced once"),
    Case("unused", "unused", "a parameter no forward uses: the step ends, and it stays where one process leaves "
         "it (no gradient, so AdamW does not move it, weight decay included)"),
    Case("accumulation", "transformer", "two micro-batches, the first under no_sync(), equal one batch",
         grad_accum_steps=2, needs="no_sync"),
    Case("groups", "transformer", "two param groups, each with options of its own (the matrices at 0.8 x the "
         "learning rate and weight decay 0.05, the 1-D parameters at half of it and none): each parameter stepped "
         "with its own group's options", needs="optimizer", groups=True),
)}


def is_optimizer(cls: type) -> bool:
    """A sharded optimizer to check on its own: a torch optimizer, or a class taking `(params,
    optimizer_cls, ...)` as the course's ShardedOptimizer does."""
    if issubclass(cls, torch.optim.Optimizer):
        return True
    parameters = list(inspect.signature(cls).parameters)
    return parameters[:2] == ["params", "optimizer_cls"]


def under_plain_ddp(optimizer: type) -> type:
    """The project's plain DDP (one all-reduce per gradient), its optimizer `optimizer(params, optimizer_cls,
    **kwargs)`, `kwargs` being what `--set` gives: how a sharded optimizer is checked by name."""
    from ddp_lab.strategies import NaiveDDP

    class PlainDDPWith(NaiveDDP):
        checks_optimizer = optimizer

        def __init__(self, module, **kwargs):
            super().__init__(module)
            self.optimizer_kwargs = kwargs

        def make_optimizer(self, optimizer_cls, params=None, **kwargs):
            params = self.trainable_parameters() if params is None else params
            return optimizer(params, optimizer_cls, **kwargs, **self.optimizer_kwargs)

    PlainDDPWith.__name__ = PlainDDPWith.__qualname__ = f"NaiveDDP with {optimizer.__name__}"
    return PlainDDPWith


def imported(target: str, example: str = "my_pkg.module.MyDDP") -> tuple[str, str, object]:
    """(module name, attribute name, the attribute or None) of a dotted path; ValueError where it is no dotted path
    or its module does not import."""
    module_name, _, name = target.rpartition(".")
    if not module_name:
        raise ValueError(f"{target!r} is not a dotted path ({example})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from None
    return module_name, name, getattr(module, name, None)


def locate_class(target: str) -> type:
    """The class at a dotted path (`my_pkg.ddp.MyDDP`); ValueError saying what is wrong."""
    module_name, name, cls = imported(target)
    if not inspect.isclass(cls):
        raise ValueError(f"{module_name!r} has no class {name!r}")
    return cls


def locate(target: str) -> type:
    """The wrapper class at a dotted path (`my_pkg.ddp.MyDDP`), or the project's plain DDP around the sharded
    optimizer there (`my_pkg.optim.ShardedOptimizer`); ValueError saying what is wrong."""
    cls = locate_class(target)
    if not callable(getattr(cls, "finish_gradient_synchronization", None)) and is_optimizer(cls):
        return under_plain_ddp(cls)
    if not callable(getattr(cls, "finish_gradient_synchronization", None)):
        raise ValueError(f"{target} has no finish_gradient_synchronization(): the check calls it after backward, "
                         "as the trainer does (ddp_lab/strategies/base.py); nor is it an optimizer taking "
                         "(params, optimizer_cls, ...)")
    return cls


COURSE_BUCKET_MB = 25.0  # what the course's adapter passes, and torch DDP's default bucket_cap_mb
BUCKET_SIZES = {"25MB": "25 MB buckets, the course's", "small": "buckets of half the largest parameter"}


def bucket_knob(cls: type) -> str | None:
    parameters = inspect.signature(cls).parameters
    return next((knob for knob in BUCKET_KNOBS if knob in parameters), None)


def runs(cls: type, kwargs: dict, names: list[str]) -> list[str]:
    """The runs of the cases `names`: each case once, or, for a wrapper that takes a bucket size `--set` does
    not give, each case at both of BUCKET_SIZES (`plain@25MB`, `plain@small`): a bug can show at one size
    and hide at the other."""
    knob = bucket_knob(cls)
    if knob is None or knob in kwargs:
        return list(names)
    return [f"{name}@{size}" for name in names for size in BUCKET_SIZES]


def case_of(run: str) -> tuple[Case, str | None]:
    """A run's case and its bucket size (a BUCKET_SIZES key, or None)."""
    name, _, size = run.partition("@")
    return CASES[name], size or None


ROUNDING_SEED = 7
"""The seed of the signs with which the rounding reference moves each gradient (parity.CastSingleProcess's jitter)."""


def compute_dtype(kwargs: dict) -> torch.dtype | None:
    """The wrapper's `compute_dtype` (`--set compute_dtype=float16`) where it computes in lower precision."""
    dtype = kwargs.get("compute_dtype")
    return dtype if isinstance(dtype, torch.dtype) and dtype != torch.float32 else None


def skip_reason(case: Case, cls: type) -> str | None:
    """Why `cls` cannot run `case`, or None."""
    if case.needs == "no_sync" and not callable(getattr(cls, "no_sync", None)):
        return f"{cls.__name__} has no no_sync()"
    if case.needs == "optimizer" and getattr(cls, "checks_optimizer", None) is None:
        return "a wrapper: param groups are an optimizer's (name a sharded optimizer to check them)"
    return None


def layer_classes(layers: dict[str, str] | None) -> dict[str, type]:
    """`--layers`' kinds to the user's classes (`{"linear": "my_pkg.model.Linear", ...}`); ValueError naming what is
    wrong."""
    from ddp_lab.check.models import LAYER_KINDS

    out = {}
    for kind, path in (layers or {}).items():
        if kind not in LAYER_KINDS:
            raise ValueError(f"--layers {kind}=...: the kinds are {', '.join(LAYER_KINDS)}")
        module_name, _, name = str(path).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), name, None) if module_name else None
        except ImportError as exc:
            raise ValueError(f"--layers {kind}={path}: cannot import {module_name!r}: {exc}") from None
        if not (inspect.isclass(cls) and issubclass(cls, torch.nn.Module)):
            raise ValueError(f"--layers {kind}={path}: not a torch.nn.Module class (a dotted path: "
                             "my_pkg.model.Linear)")
        out[kind] = cls
    return out


def run_cases(rank: int, world_size: int, target: str, kwargs: dict, names: list[str],
              progress: str | None = None, same_init: bool = False,
              layer_paths: dict[str, str] | None = None) -> dict:
    """On every rank, per run (`runs`): this rank's weights right after wrapping, after training, the
    reference's after training (on rank 0, else None), and what observe.py saw it do. With a `compute_dtype`
    the reference rounds as the wrapper does (parity.CastSingleProcess, the ranks' slices as micro-batches).
    In the folder `progress`, as it goes: the run this rank is in (`rank{R}.case`) and each finished run's
    result (`{run}.rank{R}.pt`), so that a set of ranks that fails part way is not run again for the runs
    it finished. `layer_paths`: the user's own layer classes the models are built of (models.use_layers)."""
    use_layers(layer_classes(layer_paths))
    cls = locate(target)
    dtype = compute_dtype(kwargs)
    out = {}
    for name in names:
        (case, size), started, before, observer = case_of(name), {}, {}, Observer()
        # the reference casts what the wrapper ran in the compute dtype (every parameter where none was seen)
        spread: dict[str, float] = {}  # rank 0: how far one rounding per step moves each parameter (ROUNDING_SEED)
        cast = partial(CastSingleProcess, dtype=dtype, ranks=world_size, cast=observer.cast_in(dtype))
        low = ({"exact_reference": True, "reference_wrapper": cast, "spread_into": spread,
                "rounding_wrapper": partial(cast, jitter=ROUNDING_SEED)} if dtype else {})
        if progress is not None:
            Path(progress, f"rank{rank}.case").write_text(name)

        def make(module, size=size, started=started, before=before, observer=observer):
            before.update(module=module, layers=layers(module))
            observer.track(module)
            extra = dict(kwargs)
            if size is not None:
                largest = max(p.numel() * p.element_size() for p in module.parameters())
                extra[bucket_knob(cls)] = COURSE_BUCKET_MB if size == "25MB" else largest / 2 / MiB
            ties = ties_of(module)
            wrapper = cls(module, **extra)
            started.update(full_state(wrapper, ties))
            return wrapper

        optimizer = {"optimizer_cls": torch.optim.SGD, "opt_kwargs": {"lr": 0.1}} if case.sgd else {}
        optimizer["groups"] = case.groups
        state, reference, held = train_distributed(
            rank, world_size, make, case.model, grad_accum_steps=case.grad_accum_steps,
            batch_size=SEQUENCES_PER_RANK * world_size, same_init=same_init, watch=observer.watching(),
            inspect=lambda wrapper, opt, before=before: held_or_unmeasured(wrapper, opt, before),
            **optimizer, **low)
        seen = {"calls": dict(observer.calls), "in_backward": observer.in_backward, "sizes": observer.sizes,
                "overlapping": observer.overlapping(), "blocking": observer.blocking,
                "held": held, "rounding": spread}
        out[name] = (started, state, reference, seen)
        if progress is not None:
            torch.save(out[name], Path(progress, f"{name}.rank{rank}.pt"))
    return out


def held_or_unmeasured(wrapper, optimizer, before: dict) -> dict:
    """`Observer.held`, or what could not be measured where measuring raised: an error inside the check's own
    observation (a user's object it could not walk) never becomes the case's verdict."""
    try:
        return Observer.held(wrapper, optimizer, before["module"], before["layers"])
    except Exception as exc:  # noqa: BLE001 - any error of the observer's is the check's, reported as unmeasured
        return unmeasured(exc)


def finished(progress: str, names: list[str], world_size: int) -> dict:
    """Case -> each rank's result, for the cases every rank finished (run_cases' `progress` folder)."""
    paths = {n: [Path(progress, f"{n}.rank{r}.pt") for r in range(world_size)] for n in names}
    return {n: [torch.load(p, weights_only=False) for p in ps] for n, ps in paths.items()
            if all(p.exists() for p in ps)}


def in_progress(progress: str, rank: int) -> str | None:
    """The case `rank` was in when its set of ranks ended (None: it had not begun one)."""
    path = Path(progress, f"rank{rank}.case")
    return path.read_text() if path.exists() else None
