"""The parity proof: distributed training on slices == single-process training on the full batch.

Each rank builds its model from a different seed (so the start-up broadcast is what makes them
agree), rank 0 keeps a copy of the broadcast weights as the single-process reference, and both
train for a few steps on the same global batches. A rank sees only its slice; the reference sees
the whole batch. At the end every rank's weights must equal the reference's to float32 rounding.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from tests.helpers.models import CONTEXT, MODELS, VOCAB

GLOBAL_BATCH = 8
STEPS = 4
ATOL = 1e-5
RTOL = 1e-4


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, CONTEXT + 1), generator=g)


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train_reference(model, optimizer_cls, steps, opt_kwargs):
    optimizer = optimizer_cls([p for p in model.parameters() if p.requires_grad], **opt_kwargs)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, global_batch(step)).backward()
        optimizer.step()
    return model


def train_distributed(rank, world_size, make_wrapper, model_name, *, grad_accum_steps=1,
                      steps=STEPS, optimizer_cls=torch.optim.AdamW, opt_kwargs=None, make_optimizer=None,
                      set_to_none=True):
    """Returns (this rank's final state_dict, the reference's final state_dict or None)."""
    opt_kwargs = opt_kwargs or {"lr": 1e-2, "weight_decay": 0.1}
    torch.manual_seed(rank)  # different init on every rank, on purpose
    model = MODELS[model_name]()
    ddp = make_wrapper(model)
    reference = copy.deepcopy(ddp.module) if rank == 0 else None
    params = [p for p in ddp.parameters() if p.requires_grad]
    if make_optimizer is None:
        optimizer = optimizer_cls(params, **opt_kwargs)
    else:
        optimizer = make_optimizer(params, optimizer_cls, **opt_kwargs)
    local = GLOBAL_BATCH // world_size
    micro = local // grad_accum_steps
    for step in range(steps):
        optimizer.zero_grad(set_to_none=set_to_none)
        mine = global_batch(step)[rank * local:(rank + 1) * local]
        for k in range(grad_accum_steps):
            chunk = mine[k * micro:(k + 1) * micro]
            ctx = ddp.no_sync() if k < grad_accum_steps - 1 else _null()
            with ctx:
                (loss_of(ddp, chunk) / grad_accum_steps).backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
    if reference is not None:
        train_reference(reference, optimizer_cls, steps, opt_kwargs)
    state = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    return state, (reference.state_dict() if reference is not None else None)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_parity(results) -> None:
    """Every rank equals the reference, and so every rank equals every other."""
    reference = results[0][1]
    for rank, (state, _) in enumerate(results):
        for name, tensor in reference.items():
            torch.testing.assert_close(state[name], tensor, atol=ATOL, rtol=RTOL,
                                       msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")
