"""`strategy=fsdp`: hand-written FSDP (ZeRO-3). policy.py: which parameters are sharded and which
submodules are units; unit.py: one unit's shards, gathers and gradient reduction; wrapper.py: the
`FSDP` module that drives them from forward and backward hooks."""

from ddp_lab.strategies.fsdp.policy import POLICIES, Policy, plan_units
from ddp_lab.strategies.fsdp.wrapper import FSDP

__all__ = ["FSDP", "POLICIES", "Policy", "plan_units"]
