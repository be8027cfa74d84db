"""Every axis of a run applied from one place, as torchtitan's `parallelize` applies one function per axis.

`Parallelism(cfg, device)` is built once per rank: the mesh (mesh.py), pipeline parallelism's cut of the model
into stages (ddp_lab/pipeline_parallel/), tensor parallelism on what the rank keeps (ddp_lab/tensor_parallel/),
context parallelism's attention and token positions (ddp_lab/context_parallel/) and the data-parallel strategy
on the mesh's data-parallel ranks (dp, times cp where context parallelism runs: those ranks hold the same
weights). The train loop asks it for what each axis changes (the
model it trains, the strategy around it, its rows of the batch, the loss, a step: plain, or a pipeline
schedule's, the step's figures, the weights whole) and never names an axis itself. Without a mesh it changes
nothing: the strategy is built as it always was, over every rank, and a step is `train_step`.

With a mesh and one data-parallel rank (dp x cp = 1) there is no one to synchronize with: the strategy's spec is
replaced by the floor's (`strategy=none`) and the summary says so, so the TP or PP row of a sweep shows no data-parallel
collective at all.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.parallel.mesh import Mesh
from ddp_lab.rank.activations import SavedActivations
from ddp_lab.rank.step import train_step
from ddp_lab.spec.parallel import layout_of
from ddp_lab.spec.strategy import StrategySpec
from ddp_lab.tensor_parallel.loss import CrossEntropy


class Parallelism:
    def __init__(self, cfg, device: torch.device):
        self.mesh = Mesh(layout_of(cfg), device.type)
        self.tensor = self.pipeline = self.context = None
        parallel = cfg.get("parallel")
        self.device, self.context_length = device, 0
        if self.mesh.tp > 1:
            from ddp_lab.tensor_parallel import TensorParallel

            self.tensor = TensorParallel(self.mesh, parallel.tp_impl, parallel.sequence_parallel, device)
        if self.mesh.pp > 1:
            from ddp_lab.pipeline_parallel import Pipeline

            self.pipeline = Pipeline(self.mesh, parallel, device)
        if self.mesh.cp > 1:
            from ddp_lab.context_parallel import ContextParallel

            self.context_length = int(cfg.model.context_length)
            self.context = ContextParallel(self.mesh.layout, self.mesh.cp_rank, self.mesh.cp_group,
                                           str(parallel.cp_impl), int(parallel.cp_ulysses))
        self.experts = None
        if self.mesh.layout.ep > 1:
            from ddp_lab.expert_parallel import ExpertParallel

            self.experts = ExpertParallel(self.mesh.layout, str(parallel.ep_impl))
        self.moe: list = []  # the model's mixture-of-experts layers (this rank's stage's), once applied
        self.replica_map = None  # the strategy's replica map under expert parallelism (strategies/replicas.py)
        self._attached = None  # the optimizer whose steps the mixture's hooks follow
        self.loss: CrossEntropy = CrossEntropy()
        self.replaced: str | None = None  # the strategy the floor stands in for (dp = 1 under TP)
        self.whole_params = self.held_params = 0  # the model's parameters, and this rank's before its strategy
        self._activations: SavedActivations | None = None  # the plain step's, counted on its first call

    # --- the model and its strategy -------------------------------------------------------------------

    def apply(self, module: nn.Module) -> nn.Module:
        """Tensor parallelism on `module`, in place (nothing without it), context parallelism's attention and
        positions; the loss its output takes, and the parameters counted whole and as this rank holds them (before
        its strategy shards them)."""
        self.whole_params = sum(p.numel() for p in module.parameters())
        if self.context is not None:
            self.context.apply(module, self.context_length, self.device)
        if self.pipeline is not None:
            self.pipeline.cut(module)
        if self.tensor is not None:
            self.tensor.apply(module)
            self.loss = self.tensor.loss
        self._mixture(module)
        self.held_params = sum(p.numel() for p in module.parameters())
        return module

    def _mixture(self, module: nn.Module) -> None:
        """A mixture of experts (models/moe.py): its layers sum their loads over the data-parallel ranks, expert
        parallelism keeps this rank's experts and hands them its exchange, the loss carries the balancing term, and
        the strategy gets a replica map with the experts' own class (nothing without a mixture)."""
        from ddp_lab.models.moe import BalancedLoss, moe_layers
        from ddp_lab.strategies.replicas import ReplicaClass, ReplicaMap

        self.moe = moe_layers(module)
        if not self.moe:
            return
        group, replicas = self.mesh.dp_group, self.mesh.replicas

        def sum_over_replicas(tensor: torch.Tensor) -> None:
            dist.all_reduce(tensor, group=group)
        for layer in self.moe:
            layer.sum_over_replicas = sum_over_replicas if replicas > 1 else None
            layer.replicas = replicas
        if self.experts is not None:
            self.experts.apply(module)
            self.replica_map = ReplicaMap(ReplicaClass("dense", group, replicas), self.experts.replica_classes(module))
        if any(layer.balance == "aux_loss" for layer in self.moe):
            self.loss = BalancedLoss(self.loss, self.moe)

    def _attach(self, optimizer) -> None:
        """What runs after each of `optimizer`'s steps beyond the step itself, registered on the first step it takes:
        a mixture's balancing bias moved from the step's load (balance=bias; models/moe.py); nothing otherwise."""
        if self._attached is optimizer:
            return
        self._attached = optimizer
        if any(layer.balance == "bias" for layer in self.moe):
            from ddp_lab.models.moe import after_optimizer_step

            optimizer.register_step_post_hook(after_optimizer_step(self.moe))

    def data_parallel(self, spec: StrategySpec) -> StrategySpec:
        """The spec that runs on the dp axis: `spec`, or the floor's where the mesh leaves one data-parallel rank."""
        if self.mesh.device_mesh is not None and self.mesh.replicas == 1 and spec.synchronizes:
            from ddp_lab.spec.strategies import SPECS

            self.replaced = spec.name
            return SPECS["none"]()
        return spec

    def shard_ranks(self, spec: StrategySpec) -> int:
        """How many ranks share what the strategy shards: its spec's count over the dp (x cp) ranks (hsdp: its
        group)."""
        return spec.shard_ranks(self.mesh.replicas, int(os.environ.get("LOCAL_WORLD_SIZE", self.mesh.replicas)))

    def about(self) -> dict:
        """What a checkpoint records of the run's layout: the world size and the mesh (`dp x tp`)."""
        return {"world_size": self.mesh.layout.world_size, "mesh": self.mesh.layout.label()}

    def averaging(self):
        """How the strategy averages each parameter's gradient (strategies/replicas.py): the replica map under expert
        parallelism, else one class, the data-parallel ranks (dp x cp; every rank without a mesh) and their count.
        The gradient-error probe's exact average is this one."""
        from ddp_lab.strategies.replicas import ReplicaClass, ReplicaMap

        if self.replica_map is not None:
            return self.replica_map
        return ReplicaMap(ReplicaClass("dense", self.mesh.dp_group, self.mesh.replicas))

    def group(self) -> dict:
        """The keywords a strategy's runtime takes to synchronize over the dp axis (nothing: every rank), and under
        expert parallelism its replica map (the experts' copies on their own group)."""
        out = {} if self.mesh.device_mesh is None else {"process_group": self.mesh.dp_group}
        return out if self.replica_map is None else {**out, "replicas": self.replica_map}

    # --- what the loop reads ---------------------------------------------------------------------------

    @property
    def data_shard(self) -> tuple[int, int]:
        """(this rank's share, the number of shares) of each global batch: TP ranks read the same rows, and so do a
        pipeline's stages."""
        return self.mesh.dp_rank, self.mesh.dp

    def columns(self) -> torch.Tensor | None:
        """The positions of each sequence this rank reads (context parallelism's share of the tokens); None: all."""
        if self.context is None:
            return None
        return self.context.positions(self.context_length, torch.device("cpu"))

    @property
    def splits(self) -> int | None:
        """The micro-batches a step's rows are cut into: a pipeline's; None: train.grad_accum_steps."""
        return self.pipeline.m if self.pipeline is not None else None

    def step(self, model, optimizer, micro_batches: list, timer=None, before_step=None, precision=None):
        """One optimizer step: the pipeline schedule's, or `train_step`'s (its first with the activations autograd
        saves counted: rank/activations.py)."""
        self._attach(optimizer)
        if self.pipeline is not None:
            return self.pipeline.step(model, optimizer, micro_batches, timer, before_step, precision=precision,
                                      loss=self.loss)
        if self._activations is not None:
            return train_step(model, optimizer, micro_batches, timer, before_step, precision=precision,
                              loss=self.loss)
        self._activations = SavedActivations()
        hooks, done = self._activations.counting("step")
        with hooks:
            out = train_step(model, optimizer, micro_batches, timer, before_step, precision=precision, loss=self.loss)
        done()
        self._activations.largest //= len(micro_batches)  # one at a time: each micro-batch's freed by its backward
        return out

    @property
    def activation_peak(self) -> int | None:
        """The most bytes of activations this rank held at once in its first step: a pipeline stage's micro-batches
        in flight (the lab's schedules; torch's are not counted: None), else one micro-batch's."""
        if self.pipeline is not None:
            saved = getattr(self.pipeline.runner, "activations", None)
            return None if saved is None else saved.peak
        return None if self._activations is None else self._activations.largest

    def held_out_loss(self, model, inputs, targets, precision) -> torch.Tensor:
        """The mean loss of one batch, forward only (rank/held_out.py): through the pipeline's stages, or the
        model, on every rank."""
        if self.pipeline is not None:
            return self.pipeline.forward_loss(model, inputs, targets, precision, self.loss)
        with precision.autocast():
            logits = model(inputs)
        with self.loss.context():
            return self.loss(logits.float(), targets).double()

    def compile(self, model, backend) -> None:
        """`train.compile`: the strategy compiles the model (its `compile_model`); nothing counts a step through a
        dispatch mode, which would keep Dynamo from compiling it (tensor_parallel/'s `compiled`)."""
        if self.pipeline is not None and self.pipeline.runs_backward_in_halves_by_torch:
            # torch's zero bubble runs a stage's backward in two, the input half with retain_graph=True
            # (pipelining/_backward.py's stage_backward_input), which a graph compiled with donated buffers refuses:
            # "This backward function was compiled with non-empty donated buffers which requires create_graph=False
            # and retain_graph=False ... or set torch._functorch.config.donated_buffer=False" (torch 2.13). That
            # setting, as torch says: the buffers are kept, not reused (a memory saving only; the parity holds,
            # tests/parity/test_compile_mesh.py).
            import torch._functorch.config

            torch._functorch.config.donated_buffer = False
        model.compile_model(backend)
        if self.tensor is not None:
            self.tensor.compiled = True

    def counting(self, step: int):
        """A context around `step`: where torch's TP collectives are counted (in one step), nothing elsewhere."""
        return self.tensor.counting(step) if self.tensor is not None else nullcontext()

    def pop(self) -> dict:
        """This step's figures of the axes beyond data parallelism (the TP axis's collectives, the pipeline's)."""
        from ddp_lab.models.moe import load_figures

        return {**(self.tensor.pop() if self.tensor is not None else {}),
                **(self.pipeline.pop() if self.pipeline is not None else {}),
                **(self.context.pop() if self.context is not None else {}),
                **(self.experts.pop() if self.experts is not None else {}),
                **load_figures(self.moe), **(self.loss.pop() if hasattr(self.loss, "pop") else {})}

    def drop(self) -> None:
        """Forget the figures of what ran since the last step (the held-out loss's forwards): no step's."""
        if self.tensor is not None:
            self.tensor.pop()
        if self.pipeline is not None:
            self.pipeline.pop()
        if self.context is not None:
            self.context.drop()
        if self.experts is not None:
            self.experts.drop()

    def whole(self, state: dict) -> dict:
        """A state dict (whole over the dp axis) in the single-process layout: put back together over the TP group,
        and the stages' parameters gathered over the pipeline (every rank gets them), the experts over their
        expert-parallel group. Collective."""
        if self.experts is not None:
            state = self.experts.whole(state)
        if self.tensor is not None:
            state = self.tensor.layout.whole(state)
        if self.pipeline is not None:
            stages = [None] * self.mesh.pp
            dist.all_gather_object(stages, {k: v.cpu() for k, v in state.items()}, group=self.mesh.pp_group)
            state = {k: v for stage in stages for k, v in stage.items()}
        return state

    @property
    def place(self):
        """Where this rank's tensors lie in the whole parameters, for checkpoints (rank/checkpoint.py's `place`):
        tensor parallelism's pieces, under the name one process gives the parameter (a pipeline's copy of a weight
        tied across stages is that weight; expert parallelism's run of experts); None where every tensor is whole
        under its own name."""
        split = None if self.tensor is None else self.tensor.layout.pieces
        experts = None if self.experts is None else self.experts.pieces
        alias = {} if self.pipeline is None else self.pipeline.aliases
        if split is None and experts is None and not alias:
            return None

        def place(name: str, shape, pieces: list) -> tuple:
            for where in (split, experts):
                name, shape, pieces = where(name, shape, pieces) if where is not None else (name, shape, pieces)
            return alias.get(name, name), shape, pieces
        return place

    def describe(self, warmup_steps: int = 0) -> dict:
        """The mesh, as the summary records it (a pipeline's summary gathered from every rank: collective)."""
        out = self.mesh.describe()
        if self.tensor is not None:
            out.update(self.tensor.describe())
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline.describe(warmup_steps)
        if self.context is not None:
            out["context"] = self.context.describe(warmup_steps)
        if self.experts is not None:
            out["experts"] = self.experts.describe(warmup_steps)
        elif self.moe:
            from ddp_lab.models.moe import expert_bytes

            out["experts"] = {"ep": 1, "impl": None, "experts_per_rank": self.moe[0].experts.count,
                              "expert_param_bytes": expert_bytes(self.moe)}
        if self.replaced is not None:
            out["data_parallel"] = (f"none: the dp axis has one rank, strategy={self.replaced} has no one to "
                                    "synchronize with (the floor runs in its place)")
        return out
