"""This rank's mesh: one torch DeviceMesh with named axes (`pp`, `dp`, `cp`, `tp`), built once per rank.

The layout (which ranks share each axis) is spec/parallel.py's `MeshLayout`; here it becomes torch's
DeviceMesh, whose `tp` group the tensor-parallel layers talk over, whose `pp` group a pipeline's stages send
and receive on, whose `cp` group context parallelism exchanges a sequence's keys and values over, and whose
data-parallel ranks every strategy synchronizes over: the `dp` axis, or dp x cp flattened into one group where
context parallelism runs (its ranks hold the same weights, each having seen its own tokens; torchtitan shards
FSDP over the same flattened group). Without a mesh axis there is no mesh to build: the data-parallel group is
the whole world (None, torch's default group), so a 1-D job runs exactly as it always has.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_lab.spec.parallel import MeshLayout


class Mesh:
    """This rank's place on the (pp, dp, cp, tp) grid and each axis's process group."""

    def __init__(self, layout: MeshLayout, device_type: str = "cpu"):
        self.layout = layout
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.dp_rank, self.tp_rank = layout.coordinates(rank)
        self.pp_rank, self.cp_rank = layout.pp_index(rank), layout.cp_index(rank)
        self.device_mesh = None
        self.dp_group = self.tp_group = self.pp_group = self.cp_group = None  # None: the whole world
        if layout.tp > 1 or layout.pp > 1 or layout.cp > 1:
            self.device_mesh, self.dp_group = _groups(layout, device_type)
            self.tp_group, self.pp_group, self.cp_group = (self.device_mesh.get_group(axis)
                                                           for axis in ("tp", "pp", "cp"))

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def replicas(self) -> int:
        """The ranks holding the same weights, which the strategy synchronizes: dp x cp."""
        return self.layout.dp * self.layout.cp

    def describe(self) -> dict:
        return self.layout.describe()


_BUILT: dict[tuple, tuple] = {}
"""(device type, layout) -> (DeviceMesh, data-parallel group), per process: a job builds one mesh; a
parity fixture that trains many jobs in one set of ranks builds each layout once (each gloo group keeps its threads
for the life of the process: 150 meshes built afresh left 2,000 threads a rank)."""


def _groups(layout: MeshLayout, device_type: str) -> tuple:
    """The layout's DeviceMesh and its data-parallel group: the mesh's `dp` axis, or dp x cp flattened (collective:
    every rank builds every dp x cp group, in the same order)."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (device_type, layout)
    if key not in _BUILT or not _alive(_BUILT[key][0]):
        mesh = DeviceMesh(device_type, torch.tensor(layout.grid()), mesh_dim_names=("pp", "dp", "cp", "tp"))
        dp_group = mesh.get_group("dp") if layout.cp == 1 else dist.new_subgroups_by_enumeration(layout.dp_groups())[0]
        _BUILT[key] = (mesh, dp_group)
    return _BUILT[key]


def _alive(mesh) -> bool:
    """Whether the mesh's groups belong to the current default process group (a process that re-initialized its
    world, as a test's ranks may, builds anew)."""
    return mesh.get_group("pp") in dist.distributed_c10d._world.pg_map
