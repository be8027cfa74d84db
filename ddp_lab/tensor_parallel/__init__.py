"""Tensor parallelism: a model's plan (its `tp_plan()`, spec/parallel.py's styles) applied by the lab's own
Megatron layers (`parallel.tp_impl=lab`: lab.py on layers.py and comm.py) or by torch's DTensor
(`parallel.tp_impl=torch`: torch_plan.py), the loss its split logits take (loss.py), where every element of a
split parameter lies (layout.py), and the TP axis's figures.

`TensorParallel` is what a rank holds of it; ddp_lab/parallel/ builds it once and applies it to the model
before the data-parallel strategy wraps the model.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from ddp_lab.spec.figures import COLLECTIVES, COMM, COMM_BYTES, TP_COLLECTIVES, TP_COMM, TP_COMM_BYTES
from ddp_lab.spec.parallel import TPImpl
from ddp_lab.strategies.collectives import broadcast_module_state
from ddp_lab.tensor_parallel.comm import TPContext
from ddp_lab.tensor_parallel.count import FunctionalCollectives
from ddp_lab.tensor_parallel.layout import TPLayout
from ddp_lab.tensor_parallel.loss import CrossEntropy

COUNTED_STEP = 0
"""torch's TP collectives are counted in this step (a warm-up step): count.py says why only one."""


class TensorParallel:
    """This rank's tensor parallelism over the mesh's `tp` group (ddp_lab/parallel/mesh.py)."""

    def __init__(self, mesh, impl: str, sequence_parallel: bool, device: torch.device):
        self.mesh, self.impl, self.sequence_parallel = mesh, TPImpl(str(impl)), bool(sequence_parallel)
        self.context = TPContext.over(mesh.tp_group, self.sequence_parallel, device)
        self.layout = TPLayout(mesh.tp_group, mesh.tp, mesh.tp_rank)
        self.loss: CrossEntropy = CrossEntropy()
        self.counted: dict | None = None  # torch's collectives of the counted step

    def apply(self, module: nn.Module) -> nn.Module:
        """Split `module` in place by its plan. Every TP rank first takes TP rank 0's whole weights (each rank
        built its own, from its own seed), so the pieces are of one model, as DTensor's `distribute_tensor`
        scatters from one rank too."""
        if not hasattr(module, "tp_plan"):
            raise ValueError(f"{type(module).__name__} declares no tensor-parallel plan (tp_plan())")
        plan = {name: style for name, style in module.tp_plan().items() if present(module, name)}  # a stage's own
        broadcast_module_state(module, group=self.mesh.tp_group)
        if self.impl == TPImpl.lab:
            from ddp_lab.tensor_parallel.lab import parallelize

            self.loss = parallelize(module, plan, self.context, self.layout)
        else:
            from ddp_lab.tensor_parallel.torch_plan import parallelize

            self.loss = parallelize(module, plan, self.mesh.device_mesh["tp"], self.sequence_parallel, self.layout)
        return module

    compiled = False
    """Set where the model runs compiled: torch's collectives are then not counted, as the dispatch mode that counts
    them makes Dynamo skip every frame it sees (and remember the skip: the step and every later one ran eager)."""

    def counting(self, step: int):
        """Around a step: torch's collectives are counted in COUNTED_STEP (the lab's count themselves)."""
        if self.impl == TPImpl.torch and step == COUNTED_STEP and not self.compiled:
            return _Counted(self)
        return nullcontext()

    def pop(self) -> dict:
        """This step's TP figures: the lab's measured (time, calls, bytes), torch's counted in one step."""
        if self.impl != TPImpl.lab:
            return {}
        figures = self.context.comm.pop()  # the data-parallel figures' keys: renamed to the TP axis's
        self.context.totals()
        renamed = {COMM.key: TP_COMM.key, COLLECTIVES.key: TP_COLLECTIVES.key, COMM_BYTES.key: TP_COMM_BYTES.key}
        return {renamed[key]: value for key, value in figures.items() if key in renamed}

    def describe(self) -> dict:
        """What the summary says of the TP axis."""
        out = {"tp_impl": str(self.impl), "sequence_parallel": self.sequence_parallel}
        if self.counted is not None:
            out["tp_counted"] = {**self.counted, "step": COUNTED_STEP,
                                 "how": "DTensor's functional collectives, counted by a dispatch mode in this step"}
        return out


def present(module: nn.Module, name: str) -> bool:
    """The layer `name` is on this rank: not one a pipeline cut away (nn.Identity in its place, or inside one)."""
    node = module
    for part in name.split("."):
        if isinstance(node, nn.Identity) or not hasattr(node, part):
            return False
        node = getattr(node, part)
    return not isinstance(node, nn.Identity)


class _Counted:
    def __init__(self, tp: TensorParallel):
        self.tp, self.mode = tp, FunctionalCollectives()

    def __enter__(self):
        self.mode.__enter__()

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self.tp.counted = self.mode.totals()
