"""How ZeRO-1's owners can share their updated parameters: three ways, timed side by side.

After each owner's AdamW step on its shard, every rank needs every updated parameter. This times
the update plus that exchange, with the owner map ShardedOptimizer uses, on the small Transformer:

- flat: each owner flattens its shard into one fresh buffer, one broadcast per owner, receivers
  unflatten (what ShardedOptimizer did at first).
- per_param: one async broadcast per parameter straight into it, all in flight at once
  (ShardedOptimizer now, and torch's ZeroRedundancyOptimizer).
- interleaved: the shard is updated in ~25 MiB chunks and each chunk's broadcasts start as soon
  as it is done, so updating overlaps sending (not built into ShardedOptimizer: see
  docs/benchmarks.md, "ZeRO-1").

    torchrun --standalone --nproc-per-node 2 benchmarks/zero1_param_sync.py

Prints, per method, the wall time of update + exchange for each repeat (ms; in brackets the part
spent in the optimizer step), as seen by rank 0. Needs ~3 GiB per rank.
"""

import time

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddp_lab.config import compose_model
from ddp_lab.models import build_model
from ddp_lab.strategies.zero1 import assign_owners

CHUNK_BYTES = 25 * 2**20
REPEATS = 6


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    params = list(build_model(compose_model("small")).parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    owners = assign_owners([p.numel() * p.element_size() for p in params], world)
    mine = [p for p, owner in zip(params, owners) if owner == rank]
    optimizer = torch.optim.AdamW(mine, lr=1e-4)
    optimizer.step()  # state allocated before timing

    def timed_step():
        start = time.perf_counter()
        optimizer.step()
        return time.perf_counter() - start

    def flat():
        update = timed_step()
        pending = []
        for owner in range(world):
            shard = [p for p, o in zip(params, owners) if o == owner]
            buffer = _flatten_dense_tensors([p.detach() for p in shard]) if owner == rank else \
                torch.empty(sum(p.numel() for p in shard))
            pending.append((shard, buffer, owner, dist.broadcast(buffer, src=owner, async_op=True)))
        for shard, buffer, owner, work in pending:
            work.wait()
            if owner != rank:
                for p, value in zip(shard, _unflatten_dense_tensors(buffer, shard)):
                    p.data.copy_(value)
        return update

    def per_param():
        update = timed_step()
        for work in [dist.broadcast(p.data, src=owner, async_op=True) for p, owner in zip(params, owners)]:
            work.wait()
        return update

    def interleaved():
        chunks = [[] for _ in range(world)]  # per owner, consecutive params up to CHUNK_BYTES
        for p, owner in zip(params, owners):
            if not chunks[owner] or sum(q.numel() * q.element_size() for q in chunks[owner][-1]) >= CHUNK_BYTES:
                chunks[owner].append([])
            chunks[owner][-1].append(p)
        order = [(owner, chunks[owner][k]) for k in range(max(map(len, chunks)))
                 for owner in range(world) if k < len(chunks[owner])]  # round robin: the same on every rank
        grads, works, update = {p: p.grad for p in mine}, [], 0.0
        try:
            for p in mine:
                p.grad = None  # the optimizer skips parameters without a gradient
            for owner, chunk in order:
                if owner == rank:
                    for p in chunk:
                        p.grad = grads[p]
                    update += timed_step()
                    for p in chunk:
                        p.grad = None
                works += [dist.broadcast(p.data, src=owner, async_op=True) for p in chunk]
        finally:
            for p in mine:
                p.grad = grads[p]
        for work in works:
            work.wait()
        return update

    for method in (flat, per_param, interleaved):
        times = []
        for _ in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            update = method()
            dist.barrier()
            times.append(f"{(time.perf_counter() - start) * 1e3:.0f} ({update * 1e3:.0f})")
        if rank == 0:
            print(f"{method.__name__:12s} {world} ranks: " + "  ".join(times), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
