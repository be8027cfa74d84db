"""`strategy=fsdp`: hand-written FSDP (ZeRO-3). Which parameters are sharded and which submodules are
units is the plan every process reads (ddp_lab/spec/strategies/fsdp_units.py); unit.py: one unit's
shards, gathers and gradient reduction; wrapper.py: the `FSDP` module that drives them from forward and
backward hooks."""

from ddp_lab.spec.strategies.fsdp_units import POLICIES, Policy, plan_units
from ddp_lab.strategies.fsdp.wrapper import FSDP

__all__ = ["FSDP", "POLICIES", "Policy", "plan_units"]
