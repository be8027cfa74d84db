"""Expert parallelism: a mixture of experts' experts split over `parallel.ep` ranks borrowed from the data-parallel
region (dp x cp), as torchtitan lays it out; each expert's copies on the rest (its expert-data-parallel group).

`ExpertParallel(layout, impl)` is built once per rank by `Parallelism` (ddp_lab/parallel/). `apply(model)`
keeps this rank's run of experts in every MoE layer (models/moe.py), taken from the experts of its ep group's first
rank, so the group starts from one model as every other axis does, and hands each layer the exchange that sends its
rows to their experts' ranks and back: the lab's (exchange.py) or torch's parts (torch_exchange.py). The model asks
for nothing else: routing, the scores and the combine are per token.

Gradients: an expert's gradient already sums every ep rank's tokens (the combine's backward brings them), so its
copies are summed over its expert-data-parallel group and divided by dp x cp, the same divisor as the dense weights'
(averaged over the edp group alone it would be ep times too large): `replica_classes` says so to the strategy
(strategies/replicas.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.expert_parallel.exchange import LabExchange, Tally
from ddp_lab.expert_parallel.torch_exchange import TorchExchange
from ddp_lab.models.moe import expert_bytes, moe_layers
from ddp_lab.strategies.replicas import ReplicaClass

EXPERT_TENSORS = ("w1", "w2", "w3")
"""The names of an `Experts` module's stacked weights."""


class ExpertParallel:
    def __init__(self, layout, impl: str):
        """Collective: every rank builds every ep and edp group, in the same order."""
        self.ep, self.impl = layout.ep, impl
        me = dist.get_rank()
        self.index = layout.ep_index(me)
        self.group, _ = dist.new_subgroups_by_enumeration(layout.ep_groups())
        self.edp_group, _ = dist.new_subgroups_by_enumeration(layout.edp_groups())
        self.divisor = layout.replicas
        self.tally = Tally()
        self.exchange = (TorchExchange if impl == "torch" else LabExchange)(self.ep, self.group, self.tally)
        self.layers: list = []
        self.local_numel: dict[str, int] = {}

    def apply(self, module: nn.Module) -> None:
        """This rank's experts in every MoE layer (from its ep group's first rank's), and the exchange."""
        self.layers = moe_layers(module)
        root = dist.get_global_rank(self.group, 0)
        for layer in self.layers:
            experts = layer.experts
            share = experts.count // self.ep
            for name in EXPERT_TENSORS:
                whole = getattr(experts, name).data
                dist.broadcast(whole, src=root, group=self.group)
                mine = whole[self.index * share:(self.index + 1) * share].clone()
                setattr(experts, name, nn.Parameter(mine, requires_grad=getattr(experts, name).requires_grad))
            experts.first = self.index * share
            layer.exchange = self.exchange
        self.local_numel = {name: p.numel() for name, p in module.named_parameters()
                            if any(p is q for layer in self.layers for q in layer.experts.parameters())}
        """Each expert tensor's elements on this rank, by its name in the model (the checkpoint's and the state
        dict's)."""

    def replica_classes(self, module: nn.Module) -> dict[int, ReplicaClass]:
        """Every expert parameter's class for the replica map: copies on the edp group, summed there and divided by
        dp x cp."""
        experts = ReplicaClass("experts", self.edp_group, self.divisor)
        return {id(p): experts for layer in moe_layers(module) for p in layer.experts.parameters()}

    def _is_expert(self, name: str) -> bool:
        return name in self.local_numel

    def whole(self, state: dict) -> dict:
        """A state dict with every expert whole (gathered over the ep group, in expert order). Collective."""
        out = dict(state)
        for name, tensor in state.items():
            if self._is_expert(name):
                pieces = [torch.empty_like(tensor) for _ in range(self.ep)]
                dist.all_gather(pieces, tensor.contiguous(), group=self.group)
                out[name] = torch.cat(pieces)
        return out

    def pieces(self, name: str, shape, pieces: list) -> tuple:
        """Where this rank's pieces ((offset in its tensor flattened, 1-D view)) of an expert tensor lie in the whole
        one (its experts are a run of rows: one offset more), for checkpoints (rank/checkpoint.py's `place`); other
        tensors as they are. `shape` None: the optimizer state's call, which reads the name and pieces only."""
        if not self._is_expert(name):
            return name, shape, pieces
        start = self.index * self.local_numel[name]
        whole = None if shape is None else (shape[0] * self.ep, *shape[1:])
        return name, whole, [(start + offset, view) for offset, view in pieces]

    def pop(self) -> dict:
        """This step's figures: the all-to-alls' bytes and time."""
        return self.tally.pop()

    def drop(self) -> None:
        self.tally.pop()

    def describe(self, warmup_steps: int = 0) -> dict:
        """What the summary records: ep, the implementation, this rank's experts per layer and the first's index,
        the bytes of the experts' parameters it holds (they fall as 1/ep), and the rank holding the busiest experts:
        the one whose experts took in the most rows over the run (forwards; every rank's tokens routed to them), with
        its rows over the mean rank's. Collective: every rank's count is gathered."""
        held = self.layers[0].experts.count if self.layers else 0
        rows = [0] * dist.get_world_size()
        dist.all_gather_object(rows, self.tally.rows)
        mine = [rows[r] for r in dist.get_process_group_ranks(self.group)]
        busiest = max(range(len(rows)), key=lambda r: rows[r])
        return {"ep": self.ep, "impl": self.impl, "experts_per_rank": held, "first_expert": self.index * held,
                "expert_param_bytes": expert_bytes(self.layers), "rows_per_rank": rows, "busiest_rank": busiest,
                "busiest_rows_over_mean": rows[busiest] / (sum(rows) / len(rows)) if sum(rows) else None,
                "ep_group_rows": mine}

