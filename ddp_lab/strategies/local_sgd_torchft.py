"""`strategy=local_sgd_torchft`: torchft's own (streaming) DiLoCo, `torchft.local_sgd.DiLoCo`, behind the strategy
contract: the in-run reference for `strategy=local_sgd` with the same knobs (an optional extra:
`pip install -e ".[torchft]"`).

Each ddp-lab rank is one torchft replica group of one rank: rank 0 starts torchft's Lighthouse in-process
(the quorum server every replica asks before each sync; its address reaches the others by one broadcast),
and every rank runs a `torchft.Manager` on a `torchft.process_group.ProcessGroupGloo` of its own, with a
TCPStore of its own for it. `make_optimizer` builds the inner optimizer as every strategy does and enters
`DiLoCo(manager, fragments, inner, outer, sync_every, fragment_sync_delay=delay,
fragment_update_alpha=mix)`, whose optimizer hooks do the rest. The fragments are ours
(`local_sgd.split_fragments`, each handed to torchft as a module holding its parameters), so both cut the
model the same way; the outer optimizers are DiLoCo's SGD (lr 0.7, Nesterov momentum 0.9) per fragment,
or SGD lr 1 for `outer=none` (θ - 1·(θ - mean) is the mean).

torchft's collectives are its own process group's, not torch.distributed's, so the figures come from
wrapping its manager: each `manager.allreduce` (one per parameter tensor of the fragment: torchft's
default, no bucketization) is stamped and carried across steps (`CommStats.carry`), its bytes counted
where it is launched; each fragment's `perform_sync` (the wait, then the outer step and the merge) is
exposed optimizer comm. What torchft adds beyond ours is there too: a quorum round-trip to the
Lighthouse before each fragment's sync (`start_quorum`), and a backup copy of the parameters on the
CPU (`kept_tensors` cannot see torchft's own copies: the census counts them as unaccounted).

torchft's own constraints, refused before launch by its spec: `sync_every` divisible by `fragments`, and
`delay` below `sync_every / fragments` (one fragment in flight at a time). Host network only (its
servers advertise this host's name, which another emulated node's namespace does not resolve to it).
Its parameters should equal ours to float rounding (tests/parity/test_local_sgd_torchft.py).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.strategies.base import DataParallelBase
from ddp_lab.strategies.comm_stats import begin_stamp, end_when_done
from ddp_lab.strategies.local_sgd import OUTER_LR, OUTER_MOMENTUM, split_fragments
from ddp_lab.units import tensor_bytes

TIMEOUT = timedelta(seconds=60)


class Fragment(nn.Module):
    """A fragment's parameters (the model's own) under a module: what torchft's DiLoCo takes as a fragment."""

    def __init__(self, params: list[nn.Parameter]):
        super().__init__()
        for i, p in enumerate(params):
            self.register_parameter(f"p{i}", p)


class TorchftDiLoCo(DataParallelBase):
    """torchft's DiLoCo behind the strategy contract (module docstring)."""

    def __init__(self, module: nn.Module, sync_every: int = 4, outer: str = "none", fragments: int = 1,
                 delay: int = 0, mix: float = 0.0):
        from torchft import Manager
        from torchft._torchft import LighthouseServer
        from torchft.process_group import ProcessGroupGloo

        super().__init__(module)
        self.sync_every, self.outer, self.delay, self.mix = sync_every, str(outer), delay, float(mix)
        self._params = self.trainable_parameters()
        self._fragments = [Fragment(f) for f in split_fragments(self._params, fragments)]
        rank, world = dist.get_rank(), dist.get_world_size()
        address = [None]
        if rank == 0:
            self._lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world)
            address = [self._lighthouse.address()]
        dist.broadcast_object_list(address, src=0)
        host = socket.gethostname()
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        self.manager = Manager(pg=ProcessGroupGloo(timeout=TIMEOUT), min_replica_size=world,
                               load_state_dict=lambda state: None, state_dict=lambda: {}, replica_id=str(rank),
                               store_addr=host, store_port=self._store.port, rank=0, world_size=1,
                               lighthouse_addr=address[0], port=0, timeout=TIMEOUT, use_async_quorum=False,
                               init_sync=False)
        self._count_collectives()
        self._diloco = None

    def _count_collectives(self) -> None:
        """Stamp every all-reduce torchft's manager launches, and carry it across steps."""
        allreduce, comm = self.manager.allreduce, self.comm

        def counted(tensor, *args, **kwargs):
            stamp = begin_stamp(tensor_bytes(tensor), tensor.is_cuda)
            work = allreduce(tensor, *args, **kwargs)
            end_when_done(stamp, work, tensor.is_cuda)
            comm.carry(stamp)
            return work

        self.manager.allreduce = counted

    def make_optimizer(self, optimizer_cls, params=None, **kwargs) -> torch.optim.Optimizer:
        """The inner optimizer, with torchft's DiLoCo hooked onto it."""
        from torchft.local_sgd import DiLoCo

        inner = super().make_optimizer(optimizer_cls, params, **kwargs)
        outer = [torch.optim.SGD(f.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
                 if self.outer == "nesterov" else torch.optim.SGD(f.parameters(), lr=1.0) for f in self._fragments]
        self._diloco = DiLoCo(self.manager, self._fragments, inner, outer, sync_every=self.sync_every,
                              fragment_sync_delay=self.delay, fragment_update_alpha=self.mix)
        self._diloco.__enter__()  # its optimizer hooks, for the whole run
        for fragment in self._diloco._fragments:
            fragment.perform_sync = self._exposed(fragment.perform_sync)
        return inner

    def _exposed(self, perform_sync):
        comm = self.comm

        def timed():
            with comm.exposed(in_optimizer=True):
                return perform_sync()

        return timed

    def finish_gradient_synchronization(self) -> None:
        """Nothing to synchronize: each rank steps on its own gradients."""

    def close(self) -> None:
        """Stop torchft's manager and, on rank 0, its Lighthouse, once every rank is done with them (a barrier: a
        quorum still in flight on another rank would lose its server). A job's one wrapper ends with its process; a
        process that builds several (the parity tests, one per scenario) closes each before the next, so an old
        manager stops heartbeating and an old Lighthouse is not dropped by the garbage collector at any moment,
        beside the live one's quorum (CI's extras pass once saw that quorum fail with "transport error")."""
        dist.barrier()
        self.manager.shutdown(wait=True)
        if getattr(self, "_lighthouse", None) is not None:
            self._lighthouse.shutdown()
            self._lighthouse = None

    def facts(self) -> dict:
        fragment_bytes = [sum(tensor_bytes(p) for p in f.parameters()) for f in self._fragments]
        return {"local_sgd": {"sync_every": self.sync_every, "outer": self.outer, "bytes_per_sync": sum(fragment_bytes),
                              "fragments": len(self._fragments), "fragment_bytes": fragment_bytes,
                              "peak_bytes_per_step": max(fragment_bytes), "delay": self.delay, "mix": self.mix,
                              "implementation": "torchft"}}
