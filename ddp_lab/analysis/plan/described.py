"""A system described on the command line (`--flops`, `--bandwidth`, `--memory`): a TPU-like chip, or any accelerator
the predictor's table lacks.

Its collectives are priced as the calculator counts them (ddp_lab/analysis/mesh_accounting.py): a ring moving
2(n-1)/n of an all-reduce's tensor and (n-1)/n of an all-gather's or a reduce-scatter's over each chip's link, at
the bandwidth of the mesh axis it runs on, with no latency and nothing of NCCL's protocols, so that the planner's
answer and the calculator's for the same numbers can be laid side by side (docs/plan.md, "The course's problem").
"""

from __future__ import annotations

from dataclasses import dataclass

from ddp_lab.analysis.predict.costs import PredictError
from ddp_lab.analysis.predict.systems import SYSTEMS, System

AXES = ("dp", "tp", "pp", "cp")
GB = 1e9


@dataclass(frozen=True)
class DescribedSystem(System):
    axis_Bps: tuple = ()  # (axis, bytes/s per chip) for each of AXES

    def bandwidth(self, axis: str) -> float:
        return dict(self.axis_Bps)[axis]

    def ring_ms(self, op: str, nbytes: float, n: int, axis: str) -> float:
        moved = 2 if op == "all_reduce" else 1
        return moved * (n - 1) / n * nbytes / self.bandwidth(axis) * 1e3


def parse_bandwidth(text: str) -> dict[str, float]:
    """`4.5e11` (every axis) or `dp=3.6e11,tp=1.8e11` (bytes/s per chip on each axis; an axis not named takes the
    slowest named one)."""
    try:
        if "=" not in text:
            return dict.fromkeys(AXES, float(text))
        named = {}
        for item in text.split(","):
            axis, _, value = item.partition("=")
            if axis not in AXES:
                raise ValueError
            named[axis] = float(value)
    except ValueError:
        raise PredictError(f"--bandwidth takes bytes/s, one value or per axis ({'=..,'.join(AXES)}=..), got "
                           f"{text!r}") from None
    slowest = min(named.values())
    return {axis: named.get(axis, slowest) for axis in AXES}


def described(flops: float, bandwidth: str, memory_gb: float | None, hbm_Bps: float | None,
              chips_per_node: int) -> DescribedSystem:
    """Every chip `flops` dense FLOP/s (at MFU 1 unless `--mfu` says otherwise: the problem's T_math), `memory_gb`
    (80 unset), the links of `bandwidth`; `chips_per_node` only says where pipeline sends stay inside."""
    axes = parse_bandwidth(bandwidth)
    base = SYSTEMS["h100-nvlink"]
    return DescribedSystem(**{**base.__dict__, **dict(
        name="described", gpu="described", gpus_per_node=chips_per_node, peak_flops=flops, mfu=1.0,
        hbm_Bps=hbm_Bps or base.hbm_Bps, intra_busbw_Bps=axes["dp"], inter_busbw_Bps=axes["pp"] * chips_per_node,
        link_Bps=axes["pp"], memory_bytes=(memory_gb or 80) * GB, nvls=False,
        sources=("described on the command line",))}, axis_Bps=tuple(axes.items()))

