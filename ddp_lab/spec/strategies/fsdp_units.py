"""Which parameters fsdp shards and which submodules are its units: a `Policy`, and the plan it makes.

A policy answers two questions, each a function:

- `shards(module, attr, param)`: is this parameter sharded (over dim 0, padded so any world size
  divides it), or replicated on every rank with its gradient all-reduced?
- `is_unit(parent, module)`: is this submodule a unit, gathered together before its forward and
  reduced together after its backward? The outermost match wins (a unit is never nested in another).

Named policies (`strategy.policy`):

- `linear_embedding` (default): shard the weight matrices of linear and embedding layers; replicate
  the rest (norm weights, biases): the CS336 2026 handout's split. A linear or embedding layer is
  an `nn.Linear` or `nn.Embedding`, or any leaf module (one with no submodules: a layer, not a
  block) holding a 2-D parameter: the matrix a matmul multiplies by or a lookup indexes. So a
  user's own `Linear` and `Embedding` classes, which CS336 students write instead of subclassing
  torch's, are sharded as torch's are, and their `RMSNorm`'s 1-D weight is replicated. Units:
  every direct child of the wrapped model and every item of an `nn.ModuleList` / `nn.Sequential`,
  when it holds a parameter to shard: for the Transformer, the embedding, each block and the
  output head (the final norm holds nothing to shard and is replicated).
- `all_params`: shard every parameter of one dimension or more (torch FSDP2's default); the
  same units.

A parameter lies in a unit when every module that holds it does (a weight tied across two units
belongs to neither); parameters in no unit form the *root* unit, gathered for the whole forward
and backward. `plan_units` is shared by fsdp and fsdp_torch, so both run on the same units, and by
the step-time predictor, which replays them.

It lives with the specs because every process asks it: the ranks shard by it, the launcher checks
a model has something to shard, the predictor replays the units. It works on a model handed to it
and imports torch only then: the module itself loads none, like every spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch import nn


def _nn():
    """torch.nn, imported when a model is handed in (so torch is loaded already)."""
    from torch import nn

    return nn


@dataclass(frozen=True)
class Policy:
    shards: Callable[[nn.Module, str, nn.Parameter], bool]
    is_unit: Callable[[nn.Module, nn.Module], bool]


def linear_embedding_weights(module: nn.Module, attr: str, param: nn.Parameter) -> bool:
    """torch's Linear/Embedding weight, or a 2-D parameter of any leaf module (module docstring)."""
    nn = _nn()
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return attr == "weight" and param.dim() >= 2
    return param.dim() == 2 and next(module.children(), None) is None


def every_parameter(module: nn.Module, attr: str, param: nn.Parameter) -> bool:
    return param.dim() >= 1


def children_and_list_items(parent: nn.Module | None, module: nn.Module) -> bool:
    """Direct children of the wrapped model (given as parent=None) and items of a container; a
    container itself is never a unit (its items are)."""
    containers = (_nn().ModuleList, _nn().Sequential)
    return not isinstance(module, containers) and (parent is None or isinstance(parent, containers))


POLICIES = {
    "linear_embedding": Policy(linear_embedding_weights, children_and_list_items),
    "all_params": Policy(every_parameter, children_and_list_items),
}


def resolve_policy(policy: str | Policy) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if str(policy) not in POLICIES:
        raise ValueError(f"unknown fsdp policy {policy!r}: use one of {', '.join(POLICIES)} or a Policy")
    return POLICIES[str(policy)]


@dataclass
class Slot:
    """One place a parameter is registered: `module._parameters[attr]` (a tied one has several)."""

    module: nn.Module
    attr: str
    qualname: str


@dataclass
class ParamPlan:
    param: nn.Parameter
    name: str           # as module.named_parameters() names it
    slots: list[Slot]
    sharded: bool

    @property
    def lookup_only(self) -> bool:
        """Held by embeddings only: its backward reads the indices, never the weight, and its forward is
        a lookup, not a matmul."""
        return all(isinstance(s.module, _nn().Embedding) for s in self.slots)


@dataclass
class UnitPlan:
    name: str                   # the unit module's qualified name; "" for the root
    module: nn.Module | None    # None for the root
    params: list[ParamPlan]

    @property
    def sharded(self) -> list[ParamPlan]:
        return [p for p in self.params if p.sharded]

    @property
    def needed_in_backward(self) -> bool:
        """False for a unit of embeddings only: it is not gathered again for backward (torch's
        `set_unshard_in_backward(False)`)."""
        return not all(p.lookup_only for p in self.params)


def parameter_slots(module: nn.Module) -> dict[int, ParamPlan]:
    """Every parameter once (named as `named_parameters()` names it) with every slot that holds it."""
    plans: dict[int, ParamPlan] = {}
    names = {id(p): name for name, p in module.named_parameters()}
    seen = set()
    for mname, m in module.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is None or (id(m), attr) in seen:
                continue
            seen.add((id(m), attr))
            plan = plans.setdefault(id(p), ParamPlan(p, names[id(p)], [], False))
            plan.slots.append(Slot(m, attr, f"{mname}.{attr}" if mname else attr))
    return plans


def candidate_units(module: nn.Module, policy: Policy) -> list[tuple[str, nn.Module]]:
    """Submodules the policy calls units, outermost first, in registration order, none nested."""
    out = []

    def visit(parent: nn.Module, prefix: str, is_root: bool) -> None:
        for name, child in parent.named_children():
            qualname = f"{prefix}.{name}" if prefix else name
            if policy.is_unit(None if is_root else parent, child):
                out.append((qualname, child))
            else:
                visit(child, qualname, False)

    visit(module, "", True)
    return out


def _found(params: dict[int, ParamPlan], shown: int = 4) -> str:
    """What a model without a parameter to shard has, for the error: a few names and shapes."""
    if not params:
        return "no parameters"
    named = [f"{p.name} {tuple(p.param.shape)}" for p in params.values()]
    more = f" and {len(named) - shown} more" if len(named) > shown else ""
    return f"{len(named)} parameters: {', '.join(named[:shown])}{more}"


def plan_units(module: nn.Module, policy: str | Policy = "linear_embedding") -> list[UnitPlan]:
    """The units (those holding a parameter to shard, in registration order) and, last, the root with
    every parameter in no unit (only when it has one). Raises ValueError when nothing is sharded."""
    policy = resolve_policy(policy)
    params = parameter_slots(module)
    for plan in params.values():
        plan.sharded = any(policy.shards(s.module, s.attr, plan.param) for s in plan.slots)
    if not any(p.sharded for p in params.values()):
        raise ValueError(f"fsdp: {type(module).__name__} has no parameter the policy shards, so no unit to "
                         f"shard (found {_found(params)}; the default shards Linear and Embedding weights and any "
                         "2-D parameter of a leaf module): use policy=all_params, or a strategy that does not shard "
                         "parameters")
    owner: dict[int, int] = {}
    candidates = candidate_units(module, policy)
    members = [{id(m) for m in unit.modules()} for _, unit in candidates]
    for pid, plan in params.items():
        holders = {id(s.module) for s in plan.slots}
        for index, inside in enumerate(members):
            if holders <= inside:
                owner[pid] = index
                break
    units = []
    for index, (name, unit) in enumerate(candidates):
        mine = [plan for pid, plan in params.items() if owner.get(pid) == index]
        if any(p.sharded for p in mine):
            units.append(UnitPlan(name, unit, mine))
        else:
            for plan in mine:
                owner.pop(id(plan.param))
    rest = [plan for pid, plan in params.items() if pid not in owner]
    if rest:
        units.append(UnitPlan("", None, rest))
    return units



def unit_modules(module: nn.Module) -> list[nn.Module]:
    """The modules of `module`'s units under the default policy, in registration order (the root left out); none
    where the policy shards nothing. What replicate_torch wraps one by one and `train.compile` compiles one by one."""
    try:
        return [plan.module for plan in plan_units(module) if plan.module is not None]
    except ValueError:  # nothing to shard: no unit
        return []
