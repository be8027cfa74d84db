"""`strategy=local_sgd_torchft`: torchft's streaming DiLoCo, the in-run reference for local_sgd (optional extra)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from ddp_lab.spec.strategies.local_sgd import DiLoCoSpec
from ddp_lab.spec.strategy import require

INSTALL = 'pip install -e ".[torchft]"'


@dataclass
class TorchftLocalSGDSpec(DiLoCoSpec):
    """torchft's DiLoCo (torchft.local_sgd.DiLoCo, streaming: fragments, fragment_sync_delay,
    fragment_update_alpha) with local_sgd's knobs, each rank a replica group of one under torchft's
    Lighthouse: the bar for local_sgd. An optional extra; host network only."""

    _target_: str = "ddp_lab.spec.strategies.local_sgd_torchft.TorchftLocalSGDSpec"
    name: str = "local_sgd_torchft"

    runtime = "ddp_lab.strategies.TorchftDiLoCo"
    mesh_refusal = "each rank is a torchft replica group of its own, on a process group torchft builds over every rank"
    compile_refusal = "torchft's managers and their servers run around the model, not proven compiled"
    emulated_nodes = False  # its servers advertise this host's name, which another node's namespace cannot reach

    def check(self) -> None:
        super().check()
        require(self.sync_every % self.fragments == 0, f"strategy={self.name}: strategy.sync_every={self.sync_every} "
                f"must be a multiple of strategy.fragments={self.fragments} (torchft's DiLoCo)")
        require(self.delay < self.sync_every // self.fragments, f"strategy={self.name}: strategy.delay={self.delay} "
                f"must be below sync_every / fragments = {self.sync_every // self.fragments} (torchft syncs one "
                "fragment at a time)")

    def check_checkpoints(self) -> None:
        require(False, f"strategy={self.name} takes no checkpoints here (torchft keeps its own state)")

    def check_run(self, precision: str, grad_accum_steps: int) -> None:
        require(importlib.util.find_spec("torchft") is not None,
                f"strategy={self.name} needs torchft, which is not installed: {INSTALL}")
