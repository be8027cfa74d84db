"""`strategy=none`: the floor. The same trainer, no wrapper's work and no collective: what the model's own
forward, backward and optimizer cost on this machine, beside every strategy in the same sweep."""

from __future__ import annotations

from dataclasses import dataclass

from ddp_lab.spec.strategy import StrategySpec, require


@dataclass
class NoneSpec(StrategySpec):
    """No synchronization at all: each rank trains on its own slice of the batch alone (at world_size 1, the
    plain single-process loop). Tables show every strategy's step as a multiple of it ("x floor")."""

    _target_: str = "ddp_lab.spec.strategies.none.NoneSpec"
    name: str = "none"

    runtime = "ddp_lab.strategies.NoSync"
    mesh_refusal = None
    expert_refusal = ("it synchronizes nothing, yet no rank trains alone: an expert's gradient sums the tokens "
                      "of every rank of its expert-parallel group (the combine's backward brings them), ep times "
                      "the mean, and nothing divides it; use a strategy that averages (flat, bucketed, naive, "
                      "overlap)")
    reduces_gradients = False
    synchronizes = False

    def check_checkpoints(self) -> None:
        require(False, "strategy=none takes no checkpoints: it is the floor, where each rank may train a model of "
                "its own; checkpoint a strategy that synchronizes")
