"""The parity proof: distributed training on slices == single-process training on the full batch.

The parity tests and `python -m ddp_lab.check` (anyone's wrapper class) both run it.

Both sides run the trainer's own step (`ddp_lab.rank.step.train_step`) on the trainer's own data
(`ddp_lab.rank.data.BatchSource`): each rank builds its model from a different seed (so the
start-up broadcast is what makes them agree), rank 0 keeps a copy of the broadcast weights as the
single-process reference, and both train for a few steps on the same global batches. A rank sees
only its slice (in `grad_accum_steps` micro-batches); the reference sees the whole batch at once.
At the end every rank's weights must equal the reference's to float32 rounding.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from copy import deepcopy
from functools import partial

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.func import functional_call

from ddp_lab.check.models import BYTE_VOCAB, CONTEXT, MODELS, VOCAB
from ddp_lab.models.facts import ties_of
from ddp_lab.rank.data import BatchSource
from ddp_lab.rank.data import global_batch as data_global_batch
from ddp_lab.rank.precision import Precision
from ddp_lab.rank.step import train_step

GLOBAL_BATCH = 8
STEPS = 4
SEED = 1000
ATOL = 1e-5
RTOL = 1e-4


def data_cfg(grad_accum_steps: int = 1, batch_size: int = GLOBAL_BATCH, data: dict | None = None):
    """The keys of a run's config that `BatchSource` reads, for the test models; `data`: a data
    source's node (conf/data/), synthetic without one (text: bytes, for models.byte_transformer)."""
    vocab = BYTE_VOCAB if data and data["name"] == "text" else VOCAB
    return OmegaConf.create({"train": {"batch_size": batch_size, "seed": SEED, "grad_accum_steps": grad_accum_steps},
                             "model": {"context_length": CONTEXT, "vocab_size": vocab},
                             **({"data": data} if data else {})})


def global_batch(step: int) -> torch.Tensor:
    """The whole batch of a step, (GLOBAL_BATCH, CONTEXT + 1) tokens: what the trainer's data gives."""
    return data_global_batch(step, GLOBAL_BATCH, CONTEXT, VOCAB, SEED)


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class SingleProcess(nn.Module):
    """The reference: the model on the whole batch, with the wrapper contract and nothing to sync."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        yield

    def finish_gradient_synchronization(self) -> None:
        pass


class _GradTimes(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class CastSingleProcess(SingleProcess):
    """The single-process reference of a compute dtype, rounding as an FSDP with one does: each forward runs
    on a copy of every parameter cast to `dtype`, and backward through it at the scale of one rank's loss
    (the reference's micro-batch loss is 1/`ranks` of it: its gradient is multiplied back by `ranks` in fp32
    before it enters the low-precision graph, where a smaller one would round and underflow otherwise);
    `finish_gradient_synchronization` widens each copy's gradient, times 1/`ranks`, and adds it to the fp32
    one (the master weights), micro-batch by micro-batch as ranks sum."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, ranks: int = 1, cast=None, jitter: int | None = None):
        """`cast`: a function giving the names of the parameters to cast (the ones the wrapper ran in `dtype`: the
        course's FSDP casts its Linear and Embedding weights and leaves a norm's in fp32), or None: every one.
        `jitter` (a seed): every gradient, as it leaves `dtype`, moved by one rounding of it (the dtype's unit
        roundoff times its magnitude, a random sign per element): a reference that rounds otherwise by as much as
        one rounding per step, against which the check measures how far rounding alone moves the trained weights."""
        super().__init__(module)
        self.dtype, self.ranks, self.copies, self.cast = dtype, ranks, [], cast
        self.jitter = torch.Generator().manual_seed(jitter) if jitter is not None else None

    def forward(self, *args, **kwargs):
        names = self.cast() if self.cast is not None else None
        low = {n: (p.detach().to(self.dtype) if names is None or n in names else p.detach().clone())
               .requires_grad_(p.requires_grad) for n, p in self.module.named_parameters()}
        self.copies.append(low)
        return _GradTimes.apply(functional_call(self.module, low, args, kwargs).float(), float(self.ranks))

    def finish_gradient_synchronization(self) -> None:
        params = dict(self.module.named_parameters())
        for low in self.copies:
            for name, copy in low.items():
                if copy.grad is not None:
                    p = params[name]
                    grad = copy.grad.float()
                    if self.jitter is not None and copy.grad.dtype == self.dtype:
                        sign = torch.randint(0, 2, grad.shape, generator=self.jitter).mul_(2).sub_(1)
                        grad = grad + sign * grad.abs() * (torch.finfo(self.dtype).eps / 2)
                    grad = grad * (1.0 / self.ranks)
                    p.grad = grad if p.grad is None else p.grad + grad
        self.copies = []


def two_groups(params, lr: float) -> list[dict]:
    """The parameters in two param groups, each with options of its own, neither the optimizer's defaults (an
    optimizer that builds its inner one from the constructor's options, dropping a group's, shows in either):
    the matrices at 0.8 x the learning rate and weight decay 0.05, the 1-D ones (norms, biases) at half the
    learning rate and no weight decay."""
    params = list(params)
    return [{"params": [p for p in params if p.ndim >= 2], "lr": lr * 0.8, "weight_decay": 0.05},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": lr / 2}]


def train_reference(model, optimizer_cls, steps, opt_kwargs, micro_batches: int = 1, batch_size: int = GLOBAL_BATCH,
                    precision: str = "fp32", reference_wrapper=SingleProcess, data: dict | None = None,
                    groups: bool = False, replicas: int = 1):
    """Single-process training on the whole batch, in `micro_batches` accumulated micro-batches,
    autocast (and loss-scaled) as `precision` says; with `groups`, in `two_groups`. A mixture of experts trains as
    the one-process reference of a layout with `replicas` data-parallel ranks (models/moe.py's `one_process`: its
    balancing loss in the loss, its bias moved after each step, capacity per rank-sized group of tokens)."""
    from ddp_lab.models.moe import one_process

    reference = reference_wrapper(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_cls(two_groups(trainable, opt_kwargs["lr"]) if groups else trainable, **opt_kwargs)
    batches = BatchSource(data_cfg(micro_batches, batch_size, data), 0, 1, torch.device("cpu"))
    mixed = Precision(precision)
    loss = one_process(model, optimizer, replicas)
    for step in range(steps):
        train_step(reference, optimizer, list(batches.micro_batches(step)), precision=mixed, loss=loss)
    return model


def full_state(ddp, ties: list[list[str]] = ()) -> dict:
    """The whole model's weights: the wrapper's `full_state_dict()` (collective where parameters are
    sharded), or `gather_full_params()` (the 2026 course's FSDP: the state dict it returns, or its module's
    once it has gathered), or, for a wrapper with neither, its module's state_dict. `ties`: the names of each
    weight the model shares between layers; a name left out (a gather of `named_parameters()`, which lists a
    shared weight once, as the course's own test compares) is filled from the other name of its weight."""
    if hasattr(ddp, "full_state_dict"):
        state = ddp.full_state_dict()
    else:
        gathered = ddp.gather_full_params() if hasattr(ddp, "gather_full_params") else None
        state = gathered if isinstance(gathered, dict) else getattr(ddp, "module", ddp).state_dict()
    state = {k: v.detach().clone() for k, v in state.items()}
    for names in ties:
        present = next((n for n in names if n in state), None)
        for name in names:
            if present is not None and name not in state:
                state[name] = state[present]
    return state


def _whole(state: dict, model: nn.Module) -> dict:
    """`state`, if it holds every weight of `model` whole; else ValueError saying what the wrapper must offer."""
    expected = model.state_dict()
    wrong = [k for k, v in expected.items() if k not in state or state[k].shape != v.shape]
    if wrong:
        got = f"shape {tuple(state[wrong[0]].shape)}" if wrong[0] in state else "missing"
        raise ValueError(f"the wrapper's weights are not whole ({wrong[0]}: {got}, expected "
                         f"{tuple(expected[wrong[0]].shape)}): give it full_state_dict() or gather_full_params(), "
                         "which the check reads the weights through")
    return state


def optimizer_of(ddp, optimizer_cls, groups: bool = False, **kwargs):
    """The wrapper's `make_optimizer` (sharded optimizers) or the optimizer over its trainable parameters;
    with `groups`, those parameters in `two_groups`."""
    trainable = [p for p in ddp.parameters() if p.requires_grad]
    if not groups:
        return ddp.make_optimizer(optimizer_cls, **kwargs) if hasattr(ddp, "make_optimizer") else \
            optimizer_cls(trainable, **kwargs)
    params = two_groups(trainable, kwargs["lr"])
    return ddp.make_optimizer(optimizer_cls, params=params, **kwargs) if hasattr(ddp, "make_optimizer") else \
        optimizer_cls(params, **kwargs)


def train_distributed(rank, world_size, make_wrapper, model_name, *, grad_accum_steps=1,
                      steps=STEPS, optimizer_cls=torch.optim.AdamW, opt_kwargs=None, set_to_none=True,
                      batch_size=GLOBAL_BATCH, exact_reference=False, inspect=None, reference_wrapper=SingleProcess,
                      precision="fp32", data=None, after_step=None, same_init=False, groups=False, watch=None,
                      rounding_wrapper=None, spread_into: dict | None = None):
    """Returns (this rank's final state_dict, the reference's final state_dict or None), and with
    `inspect` a third item: `inspect(wrapper, optimizer)` after the last step.

    `exact_reference`: the reference accumulates the ranks' micro-batches as its own, in rank
    order, each loss divided by their number: at 2 ranks that is the same arithmetic as averaging the two
    ranks' gradients (halving is exact, and a + b is b + a), so a strategy can match it bit for bit.
    `reference_wrapper`: what runs the reference model (SingleProcess; a compute-dtype test casts).
    `precision`: train.precision on both sides; the loss scaler agrees over ranks whatever the wrapper
    (needed where a sharded optimizer sees only its share, the same decision where every rank holds the
    whole average). `data`: a data source's node (conf/data/; synthetic without one), on both sides.
    `after_step(wrapper)`: called on every rank after each step (the held-out loss between steps).
    `same_init`: every rank builds the model from one seed (a wrapper that does not broadcast at start).
    `groups`: the optimizer on both sides over `two_groups` of the parameters. `watch`: a context manager
    around the training steps (the check's observer). `rounding_wrapper` (with `spread_into`, a dict): rank 0 trains
    the reference a second time, from the same weights, in it (a CastSingleProcess with `jitter`), and puts each
    parameter's largest difference between the two into `spread_into`: how far one rounding per step moves it.
    """
    opt_kwargs = opt_kwargs or {"lr": 1e-2, "weight_decay": 0.1}
    torch.manual_seed(0 if same_init else rank)  # different init on every rank, on purpose, unless asked
    model = MODELS[model_name]()
    ties = ties_of(model)
    ddp = make_wrapper(model)
    start = full_state(ddp, ties)  # the broadcast weights, whole (collective: fsdp's parameters are shards)
    reference = MODELS[model_name]() if rank == 0 else None
    if reference is not None:
        reference.load_state_dict(_whole(start, reference))
    optimizer = optimizer_of(ddp, optimizer_cls, groups, **opt_kwargs)
    batches = BatchSource(data_cfg(grad_accum_steps, batch_size, data), rank, world_size, torch.device("cpu"))
    mixed = Precision(precision, agree_over_ranks=True)
    with watch if watch is not None else nullcontext():
        for step in range(steps):
            train_step(ddp, optimizer, list(batches.micro_batches(step)), set_to_none=set_to_none, precision=mixed)
            if after_step is not None:
                after_step(ddp)
    if reference is not None:
        micro_batches = world_size * grad_accum_steps if exact_reference else 1
        twin = deepcopy(reference) if rounding_wrapper is not None else None
        train_reference(reference, optimizer_cls, steps, opt_kwargs, micro_batches, batch_size,
                        precision=precision, reference_wrapper=reference_wrapper, data=data, groups=groups)
        if twin is not None:
            train_reference(twin, optimizer_cls, steps, opt_kwargs, micro_batches, batch_size,
                            precision=precision, reference_wrapper=rounding_wrapper, data=data, groups=groups)
            rounded = twin.state_dict()
            spread_into.update({n: (t - rounded[n]).abs().max().item() if t.is_floating_point() and t.numel() else 0.0
                                for n, t in reference.state_dict().items()})
    state = full_state(ddp, ties)
    out = (state, reference.state_dict() if reference is not None else None)
    return out if inspect is None else (*out, inspect(ddp, optimizer))


def train_on_mesh(rank, world_size, model_name, strategy: str = "none", *, tp: int = 1, impl: str = "lab",
                  sequence_parallel: bool = False, tp_inner: bool = True, grad_accum_steps: int = 1,
                  steps: int = STEPS, precision: str = "fp32", knobs: dict | None = None,
                  batch_size: int = GLOBAL_BATCH, optimizer_cls=torch.optim.AdamW, opt_kwargs: dict | None = None,
                  inspect=None, pipeline: dict | None = None, context: dict | None = None,
                  experts: dict | None = None, grad_error: bool = False, checkpointing: str = "none",
                  compile_backend=None, after_step=None):
    """`train_distributed` on a (dp, tp) mesh, as every job trains on one (ddp_lab/parallel/), for the model of a
    MODELS name or of a factory (a model of the user's own, with its `tp_plan()`): tensor parallelism
    (`impl`: lab or torch) on the model, `strategy` (its option, with `knobs`) on the data-parallel axis, the
    trainer's own `train_step` with the mesh's loss, each data-parallel rank on its rows of the batch. Rank 0 keeps
    a copy of its model before tensor parallelism splits it: every rank's pieces come from it (TP broadcasts TP
    rank 0's weights, the strategy its dp axis's first rank's). `optimizer_cls` (with `opt_kwargs`: lr and
    weight_decay) on both sides. Returns (this rank's weights whole: the strategy's
    `full_state_dict()` put back together over the TP ranks and the pipeline's stages, the reference's or None),
    and `inspect(parallelism, wrapper, optimizer)`'s result third when given. `pipeline`: the `parallel` node's
    pipeline keys (pp, pp_schedule, pp_impl, microbatches, stages_per_rank, stage_layers); `context`: its context
    parallelism keys (cp, cp_impl, cp_ulysses), each rank then reading its tokens of every sequence; `experts`: its
    expert parallelism keys (ep, ep_impl). `grad_error`: the job's gradient-error probe (rank/grad_error.py) measured
    before each step, its figures returned third (in `inspect`'s place). `checkpointing`: train.activation_checkpointing
    on this rank's blocks, applied after the mesh has cut them, as the trainer applies it (the reference keeps its
    activations). `compile_backend`: train.compile with that backend (a name or a callable), after the strategy wraps
    the model, as the trainer compiles it (the reference runs eager). `after_step()`: called after each step."""

    from ddp_lab.parallel import Parallelism
    from ddp_lab.rank.grad_error import GradErrorProbe
    from ddp_lab.rank.recompute import apply_activation_checkpointing
    from ddp_lab.spec.strategies import SPECS
    from ddp_lab.tasks.train import wrap

    pipeline = {"pp": 1, "microbatches": 1, "stages_per_rank": 1, "stage_layers": None, "pp_schedule": "1f1b",
                "pp_impl": "lab", **(pipeline or {})}
    context = {"cp": 1, "cp_impl": "ring", "cp_ulysses": 2, **(context or {})}
    experts = {"ep": 1, "ep_impl": "lab", **(experts or {})}
    cfg = OmegaConf.merge(data_cfg(grad_accum_steps, batch_size), {"world_size": world_size, "parallel": {
        "tp": tp, "tp_impl": impl, "sequence_parallel": sequence_parallel, "tp_inner": tp_inner, **pipeline,
        **context, **experts}})
    opt_kwargs = opt_kwargs or {"lr": 1e-2, "weight_decay": 0.1}
    parallel = Parallelism(cfg, torch.device("cpu"))
    torch.manual_seed(rank)  # different init on every rank, on purpose: the broadcasts must fix it
    model = MODELS[model_name]() if isinstance(model_name, str) else model_name()
    ties = ties_of(model)
    reference = deepcopy(model) if rank == 0 else None
    module = parallel.apply(model)
    apply_activation_checkpointing(module, checkpointing)
    probe, measured = (GradErrorProbe(module, parallel.averaging()), []) if grad_error else (None, None)
    spec = parallel.data_parallel(SPECS[strategy](**(knobs or {})))
    rest = {k: v for k, v in opt_kwargs.items() if k not in ("lr", "weight_decay")}  # wrap passes those two
    ddp, optimizer, mixed = wrap(spec, module, precision, "cpu", opt_kwargs["lr"], opt_kwargs["weight_decay"],
                                 partial(optimizer_cls, **rest), group=parallel.group())
    if compile_backend is not None:
        parallel.compile(ddp, compile_backend)
    batches = BatchSource(cfg, *parallel.data_shard, torch.device("cpu"), parallel.splits, parallel.columns())
    before_step = None if probe is None else (lambda: measured.append(probe.measure(optimizer)))
    for step in range(steps):
        with parallel.counting(step):
            parallel.step(ddp, optimizer, list(batches.micro_batches(step)), before_step=before_step,
                          precision=mixed)
        if after_step is not None:
            after_step()
    out = parallel.whole(full_state(ddp, ties))
    if reference is not None:
        train_reference(reference, optimizer_cls, steps, opt_kwargs, grad_accum_steps, batch_size,
                        precision=precision, replicas=parallel.mesh.replicas)
    result = (out, reference.state_dict() if reference is not None else None)
    if grad_error:
        return (*result, measured)
    return result if inspect is None else (*result, inspect(parallel, ddp, optimizer))


def assert_parity(results, exact: bool = False) -> None:
    """Every rank equals the reference (bit for bit when `exact`), and so every rank equals every other."""
    reference = results[0][1]
    for rank, (state, *_) in enumerate(results):
        for name, tensor in reference.items():
            if exact:
                assert torch.equal(state[name], tensor), \
                    f"rank {rank}, {name}: max diff {(state[name] - tensor).abs().max().item():.3g}"
            else:
                torch.testing.assert_close(state[name], tensor, atol=ATOL, rtol=RTOL,
                                           msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")


def per_scenario(results, names):
    """(name, [each rank's result]) for each of `names` the ranks ran."""
    for name in names:
        if name in results[0]:
            yield name, [r[name] for r in results]


def assert_parity_each(results, names) -> None:
    """`assert_parity` for every scenario, naming the one and the world size that failed."""
    for name, per_rank in per_scenario(results, names):
        try:
            assert_parity(per_rank)
        except AssertionError as error:
            raise AssertionError(f"{name} at {len(results)} ranks: {error}") from None
