"""What the model's pieces cost: one collective from its fit, the core share of compute and communication,
the tokens a rank computes. fit.py writes the constants these read; schedule.py (FittedCosts) uses them."""

from __future__ import annotations

from ddp_lab.arithmetic.bandwidth import bus_factor


class PredictError(ValueError):
    """Bad input the CLI reports in one line."""


def ring_steps(op: str, n: int) -> int:
    """Latency terms of the ring algorithm (NCCL's tuner: 2(n-1) for all-reduce, n-1 otherwise)."""
    return 2 * (n - 1) if op == "all_reduce" else (n - 1)


def collective_ms(collectives: dict, backend: str, op: str, nbytes: float, world_size: int,
                  dtype: str = "fp32", back_to_back: bool = False, cpus: float | None = None) -> float:
    """Predicted time of one collective alone: the fit at this world size, else the ring form. With
    `back_to_back`, of one blocking call right after another: the fit of calls timed that way
    (task.barrier=false) where the sweep has one, else the same as alone.

    gloo on one machine's loopback (`cpus` cores, from the profile; a sweep on network=host): every
    rank's communication thread works through the whole collective, so a ring form carried to more
    ranks than the cores hold runs at their share: time x min(1, cpus / fitted ranks) / min(1, cpus /
    ranks) (at 4 ranks on 2 cores, fitted at 2: twice as long). On an emulated link the link sets the
    pace, and on NCCL the GPUs do: no such term."""
    if world_size == 1:
        return 0.0
    try:
        by_dtype = collectives[backend][op]
    except KeyError:
        raise PredictError(f"the model has no {op} fit for backend {backend}; add it to the collective sweep") from None
    entry = by_dtype.get(dtype) or by_dtype.get("fp32")
    if entry is None:
        raise PredictError(f"the model has no {op} fit in {dtype} or fp32 for backend {backend}")
    if back_to_back and entry.get("back_to_back"):
        entry = entry["back_to_back"]
    fit = entry["by_world_size"].get(str(world_size))
    if fit is not None:
        return fit["alpha_ms"] + nbytes / (fit["beta_GBps"] * 1e9) * 1e3
    ring = entry.get("ring")
    if ring is None:
        raise PredictError(f"the model has no {op} fit at world size {world_size} and no ring form")
    alone = (ring_steps(op, world_size) * ring["alpha_step_ms"]
             + bus_factor(op, world_size) * nbytes / (ring["busbw_GBps"] * 1e9) * 1e3)
    if backend != "gloo" or not cpus or entry.get("network", "host") != "host":
        return alone
    fitted = max(ring.get("world_sizes") or [world_size])
    return alone * min(1.0, cpus / fitted) / min(1.0, cpus / world_size)


# --- contention: processor sharing on the cores -------------------------------------------------------

def share_speeds(ranks: int, cpus: float, threads_per_rank: int, u: float) -> dict:
    """Speeds (1 = alone on a core) of compute and comm, alone and together, and the slowdowns."""
    def speed(demand):
        return min(1.0, cpus / demand) if demand > 0 else 1.0
    compute_alone = speed(ranks * threads_per_rank)
    comm_alone = speed(ranks * u)
    both = speed(ranks * (threads_per_rank + u))
    return {"compute_alone": compute_alone, "comm_alone": comm_alone, "both": both,
            "compute_slowdown": compute_alone / both, "comm_slowdown": comm_alone / both}


def tokens_per_rank(cfg: dict) -> float:
    """Tokens one rank computes per step: its share of the global batch times the context length."""
    train, model = cfg["train"], cfg["model"]
    return train["batch_size"] / cfg["world_size"] * model.get("context_length", 1)


def slowdowns(contention: dict, ranks: int, profiled_ranks: int, cpus: float, threads_per_rank: int) -> tuple:
    """(compute, comm) slowdown while both run at `ranks`: the fitted pair at the profiled world size,
    scaled by the processor-sharing model's ratio between the two world sizes, with a communication
    thread's load u = compute slowdown - 1 (what that model says at a world size that fills the cores)."""
    u = contention["u"]
    here = share_speeds(ranks, cpus, threads_per_rank, u)
    there = share_speeds(profiled_ranks, cpus, threads_per_rank, u)
    compute = contention.get("compute_slowdown", there["compute_slowdown"])
    comm = contention.get("comm_slowdown", there["comm_slowdown"])
    return (max(1.0, compute * here["compute_slowdown"] / there["compute_slowdown"]),
            max(1.0, comm * here["comm_slowdown"] / there["comm_slowdown"]))
