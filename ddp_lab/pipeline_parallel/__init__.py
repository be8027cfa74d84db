"""Pipeline parallelism: the model's blocks cut into stages over the mesh's `pp` axis (stages.py), a schedule's
actions run by hand (lab.py) or by torch.distributed.pipelining (torch_schedule.py), the bubble measured.

`Pipeline` is what a rank holds of it; ddp_lab/parallel/ builds it once, cuts the model before tensor parallelism
splits what is left and the data-parallel strategy wraps it, and asks it for each step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.models.facts import ties_of
from ddp_lab.pipeline_parallel.stages import TiedAcrossStages, keep_stages
from ddp_lab.spec.figures import PP_BUBBLE, PP_P2P_BYTES, PP_WAIT
from ddp_lab.spec.pipeline import PPImpl, bubble_formula, simulate
from ddp_lab.strategies.collectives import broadcast_module_state


class Pipeline:
    """This rank's stages and the schedule that runs them."""

    def __init__(self, mesh, parallel, device: torch.device):
        self.mesh, self.device = mesh, device
        self.schedule, self.impl = str(parallel.pp_schedule), PPImpl(str(parallel.pp_impl))
        self.m, self.chunks = int(parallel.microbatches), int(parallel.stages_per_rank)
        self.counts = list(parallel.stage_layers) if parallel.stage_layers is not None else None
        if self.impl == PPImpl.lab:
            from ddp_lab.pipeline_parallel.lab import LabPipeline

            self.runner = LabPipeline(mesh, self.schedule, self.m, self.chunks, device)
        else:
            from ddp_lab.pipeline_parallel.torch_schedule import TorchPipeline

            self.runner = TorchPipeline(mesh, self.schedule, self.m, self.chunks, device)
        self.per_step: list[dict] = []

    def cut(self, module: nn.Module) -> nn.Module:
        """Keep this rank's stages of `module`, in place. Every pipeline rank first takes pipeline rank 0's whole
        weights (each rank built its own, from its own seed), so the stages are of one model and a weight tied
        across two stages starts as one."""
        broadcast_module_state(module, group=self.mesh.pp_group)
        ties = ties_of(module)
        layers = keep_stages(module, self.mesh.pp, self.mesh.pp_rank, self.chunks, self.counts)
        self.runner.ties = TiedAcrossStages(module, ties, layers, self.mesh.layout, self.mesh.pp_rank)
        self.layers = layers
        return module

    def step(self, *args, **kwargs) -> torch.Tensor:
        return self.runner.step(*args, **kwargs)

    def pop(self) -> dict:
        """This step's figures of the pipeline (the lab's: clocked per action; torch's schedules are not)."""
        figures = self.runner.figures
        if not figures:
            return {}
        self.per_step.append(figures)
        return {PP_BUBBLE.key: 100 * (1 - figures["busy_s"] / figures["span_s"]),
                PP_WAIT.key: figures["wait_s"] * 1e3, PP_P2P_BYTES.key: figures["sent_bytes"]}

    def describe(self, warmup_steps: int) -> dict:
        """The summary's pipeline: the schedule, its formula and simulated bubble, each stage's measured bubble
        and compute (mean over the measured steps), its activation peak, and the last step's timeline. Collective
        over every rank (gathered)."""
        pp = self.mesh.pp
        simulated = simulate(self.schedule, pp, self.m, self.chunks)
        measured = self.per_step[warmup_steps:] or self.per_step
        mine = {"pp_rank": self.mesh.pp_rank, "timeline": self.runner.timeline,
                "activation_peak_bytes": getattr(getattr(self.runner, "activations", None), "peak", None)}
        if measured:
            mine.update(bubble_pct=100 * sum(1 - f["busy_s"] / f["span_s"] for f in measured) / len(measured),
                        busy_ms=1e3 * sum(f["busy_s"] for f in measured) / len(measured),
                        wait_ms=1e3 * sum(f["wait_s"] for f in measured) / len(measured),
                        p2p_bytes=measured[-1]["sent_bytes"])
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        stages = {}
        for entry in everyone:  # one per pipeline rank (the first rank of each: its dp and tp peers alike)
            stages.setdefault(entry["pp_rank"], entry)
        per_stage = [stages[r] for r in range(pp)]
        formula = bubble_formula(self.schedule, pp, self.m, self.chunks)
        measured_mean = (sum(s["bubble_pct"] for s in per_stage) / pp) if measured else None
        return {"schedule": self.schedule, "impl": str(self.impl), "microbatches": self.m,
                "stages_per_rank": self.chunks, "stage_layers": [[n for n in names] for names in self.layers],
                "bubble_formula_pct": None if formula is None else 100 * formula,
                "bubble_simulated_pct": 100 * simulated.bubble(),
                "bubble_measured_pct": measured_mean, "in_flight_peak": simulated.peak_in_flight,
                "per_stage": per_stage}
