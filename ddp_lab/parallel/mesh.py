"""This rank's mesh: one torch DeviceMesh with named axes (`pp`, `dp`, `tp`), built once per rank.

The layout (which ranks share each axis) is spec/parallel.py's `MeshLayout`; here it becomes torch's
DeviceMesh, whose `tp` group the tensor-parallel layers talk over, whose `pp` group a pipeline's stages send
and receive on, and whose `dp` group every data-parallel strategy synchronizes over. Without tensor or
pipeline parallelism there is no mesh to build: the data-parallel group is the whole world (None, torch's
default group), so a 1-D job runs exactly as it always has.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_lab.spec.parallel import MeshLayout


class Mesh:
    """This rank's place on the (pp, dp, tp) grid and each axis's process group."""

    def __init__(self, layout: MeshLayout, device_type: str = "cpu"):
        self.layout = layout
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.dp_rank, self.tp_rank = layout.coordinates(rank)
        self.pp_rank = layout.pp_index(rank)
        self.device_mesh = None
        self.dp_group = self.tp_group = self.pp_group = None  # None: the whole world (torch's default group)
        if layout.tp > 1 or layout.pp > 1:
            from torch.distributed.device_mesh import DeviceMesh

            self.device_mesh = DeviceMesh(device_type, torch.tensor(layout.grid()),
                                          mesh_dim_names=("pp", "dp", "tp"))
            self.dp_group, self.tp_group, self.pp_group = (self.device_mesh.get_group(axis)
                                                           for axis in ("dp", "tp", "pp"))

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    def describe(self) -> dict:
        return self.layout.describe()
