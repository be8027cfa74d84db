"""The collective benchmark's arithmetic against hand-computed values, and a real 2-rank gloo run."""

import math

import pytest

from ddp_lab.arithmetic import bandwidth as C
from ddp_lab.arithmetic.stats import SUMMARY_KEYS
from ddp_lab.check.ranks import run_ranks
from ddp_lab.tasks.allreduce import benchmark_collective, resolve_collective


def test_bus_factors_by_hand():
    # nccl-tests PERFORMANCE.md: all-reduce 2(n-1)/n, reduce-scatter/all-gather (n-1)/n, broadcast and reduce 1.
    assert C.bus_factor("all_reduce", 2) == 1.0
    assert C.bus_factor("all_reduce", 4) == 1.5
    assert math.isclose(C.bus_factor("all_reduce", 6), 10 / 6)
    assert C.bus_factor("reduce_scatter", 4) == 0.75
    assert C.bus_factor("all_gather", 2) == 0.5
    assert C.bus_factor("broadcast", 8) == 1.0
    assert C.bus_factor("reduce", 8) == 1.0
    assert C.bus_factor("all_reduce", 1) == 0.0   # one rank moves nothing over a link
    with pytest.raises(ValueError, match="unknown collective"):
        C.bus_factor("all_to_all", 2)


def test_bandwidth_by_hand():
    # 100 MiB all-reduced at 4 ranks in 50 ms: algbw = 104857600 / 0.05 = 2.097152 GB/s,
    # busbw = 2.097152 * 1.5 = 3.145728 GB/s.
    nbytes = 100 * 2**20
    assert math.isclose(C.algbw(nbytes, 0.05), 2.097152e9)
    assert math.isclose(C.busbw("all_reduce", nbytes, 0.05, 4), 3.145728e9)
    # all-gather of 1 GB at 8 ranks in 1 s: busbw = 1e9 * 7/8.
    assert math.isclose(C.busbw("all_gather", 1e9, 1.0, 8), 0.875e9)


def test_summary_uses_median_and_slowest_rank():
    rank0 = [0.010, 0.020, 0.030, 0.500]   # one descheduled iteration
    rank1 = [0.012, 0.018, 0.031, 0.010]
    combined = C.combine_rank_times([rank0, rank1])
    assert combined == [0.012, 0.020, 0.031, 0.500]
    s = C.summarize_collective("all_reduce", 10**6, 2, combined)
    # p50 of [12, 20, 31, 500] ms = 25.5 ms; algbw = 1e6 B / 0.0255 s; busbw factor 1 at n=2.
    assert math.isclose(s["latency_ms"]["p50"], 25.5)
    assert math.isclose(s["algbw_GBps"], 1e6 / 0.0255 / 1e9)
    assert math.isclose(s["busbw_GBps"], s["algbw_GBps"])
    assert set(s["latency_ms"]) == set(SUMMARY_KEYS)
    with pytest.raises(ValueError, match="different iteration counts"):
        C.combine_rank_times([[1.0], [1.0, 2.0]])


def test_message_rounding():
    # 1 MiB of float32 = 262144 elements; at 6 ranks rounded down to 262140 (a multiple of 6).
    assert C.message_numel(2**20, 4) == 262144
    assert C.message_numel(2**20, 6) == 262140
    assert C.message_bytes(2**20, 6) == 262140 * 4
    assert C.bytes_per_rank("reduce_scatter", 800, 4) == 1000
    with pytest.raises(ValueError):
        C.message_numel(4, 2)


def _bench_all_ops(rank, world_size):
    import torch
    import torch.distributed as dist

    from ddp_lab.strategies.collectives import choose_collectives

    out = {}
    for op, implementation in [(op, "auto") for op in C.OPS] + [("reduce_scatter", "native"), ("all_gather", "native")]:
        choose_collectives(implementation)  # auto on gloo: the lab's rings for reduce-scatter and all-gather
        # Correctness of the API each op resolves to, with rank-dependent data.
        run, api, bufs = resolve_collective(op, 8, torch.device("cpu"))
        bufs["full"].copy_(torch.arange(8.0) + 10 * rank)
        bufs["chunk"].fill_(rank + 1)
        run()
        info = {}
        times = benchmark_collective(op, 64 * 1024 + 4, iters=3, warmup=2, device=torch.device("cpu"), info=info)
        back_to_back = benchmark_collective(op, 1024, iters=3, warmup=0, device=torch.device("cpu"), barrier=False)
        key = op if implementation == "auto" else f"{op} native"
        out[key] = {"api": api, "full": bufs["full"].clone(), "chunk": bufs["chunk"].clone(), "times": times,
                   "info": info, "back_to_back": back_to_back}
    dist.barrier()
    return out


def test_real_two_rank_gloo_run():
    import torch

    results = run_ranks(_bench_all_ops, 2)
    ar = torch.arange(8.0)
    for rank, res in enumerate(results):
        assert res["all_reduce"]["api"] == "all_reduce"
        assert torch.equal(res["all_reduce"]["full"], 2 * ar + 10)                 # sum over ranks
        assert torch.equal(res["broadcast"]["full"], ar)                           # rank 0's data
        if rank == 0:
            assert torch.equal(res["reduce"]["full"], 2 * ar + 10)                 # the sum, on rank 0
        # reduce-scatter: rank r gets the sum of chunk r; torch 2.13 gloo supports the tensor API.
        # reduce-scatter and all-gather: the lab's rings by default on gloo, gloo's own with native
        assert res["reduce_scatter"]["api"] == "ring_reduce_scatter"
        assert res["reduce_scatter native"]["api"] in ("reduce_scatter_single", "reduce_scatter_tensor",
                                                       "reduce_scatter")
        assert res["all_gather"]["api"] == "ring_all_gather"
        assert res["all_gather native"]["api"] in ("all_gather_single", "all_gather_into_tensor", "all_gather")
        for op in ("reduce_scatter", "reduce_scatter native"):
            assert torch.equal(res[op]["chunk"], (2 * ar + 10)[4 * rank:4 * rank + 4])
        for op in ("all_gather", "all_gather native"):
            assert torch.equal(res[op]["full"], torch.tensor([1.0] * 4 + [2.0] * 4))
        for op in res:
            assert res[op]["info"] == {"api": res[op]["api"], "bytes": 64 * 1024}   # 16385 floats -> 16384
            for times in (res[op]["times"], res[op]["back_to_back"]):
                assert len(times) == 3 and all(0 < t < 5 for t in times)
    combined = C.combine_rank_times([r["all_reduce"]["times"] for r in results])
    summary = C.summarize_collective("all_reduce", C.message_bytes(64 * 1024, 2), 2, combined)
    assert summary["busbw_GBps"] > 0


def test_back_to_back_jobs_are_named_apart():
    from ddp_lab.spec.labels import row_label, run_name

    cfg = {"task": {"name": "allreduce", "op": "all_reduce", "size_mb": 10, "barrier": False},
           "backend": {"name": "gloo"}, "world_size": 2}
    assert run_name(cfg) == "all_reduce-back-to-back-10MiB-gloo-ws2"
    assert row_label({"config": cfg}) == "all_reduce back-to-back 10 MiB"
    cfg["task"]["barrier"] = True
    assert run_name(cfg) == "all_reduce-10MiB-gloo-ws2"
