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
from ddp_lab.pipeline_parallel.stages import TiedAcrossStages, flops_balanced, keep_stages
from ddp_lab.spec.figures import PP_BUBBLE, PP_P2P_BYTES, PP_WAIT
from ddp_lab.spec.pipeline import AUTO, PPImpl, bubble_formula, microbatches_of, simulate
from ddp_lab.strategies.collectives import broadcast_module_state


class Pipeline:
    """This rank's stages and the schedule that runs them."""

    def __init__(self, mesh, parallel, device: torch.device):
        self.mesh, self.device = mesh, device
        self.schedule, self.impl = str(parallel.pp_schedule), PPImpl(str(parallel.pp_impl))
        self.m, self.chunks = microbatches_of(parallel), int(parallel.stages_per_rank)
        layers = parallel.stage_layers
        self.counts = layers if layers is None or isinstance(layers, str) else list(layers)  # "auto": at cut()
        if self.impl == PPImpl.lab:
            from ddp_lab.pipeline_parallel.lab import LabPipeline

            self.runner = LabPipeline(mesh, self.schedule, self.m, self.chunks, device)
        else:
            from ddp_lab.pipeline_parallel.torch_schedule import TorchPipeline

            self.runner = TorchPipeline(mesh, self.schedule, self.m, self.chunks, device)
        self.per_step: list[dict] = []
        self.aliases: dict[str, str] = {}  # a tied weight's other names: the name one process gives it

    def cut(self, module: nn.Module) -> nn.Module:
        """Keep this rank's stages of `module`, in place. Every pipeline rank first takes pipeline rank 0's whole
        weights (each rank built its own, from its own seed), so the stages are of one model and a weight tied
        across two stages starts as one."""
        broadcast_module_state(module, group=self.mesh.pp_group)
        if self.counts == AUTO:
            self.counts = flops_balanced(module, self.mesh.pp * self.chunks)
        ties = ties_of(module)
        layers = keep_stages(module, self.mesh.pp, self.mesh.pp_rank, self.chunks, self.counts)
        self.runner.ties = TiedAcrossStages(module, ties, layers, self.mesh.layout, self.mesh.pp_rank)
        self.aliases = {name: names[0] for names in ties for name in names[1:]}  # as named_parameters() names it
        self.layers = layers
        return module

    def step(self, *args, **kwargs) -> torch.Tensor:
        return self.runner.step(*args, **kwargs)

    @property
    def runs_backward_in_halves_by_torch(self) -> bool:
        """torch's zero bubble: each backward split into its input and weight halves by torch's own functions."""
        return self.impl == PPImpl.torch and self.schedule == "zero_bubble"

    @torch.no_grad()
    def forward_loss(self, model, inputs: torch.Tensor, targets: torch.Tensor, precision, loss) -> torch.Tensor:
        """The loss of one batch run forward through every stage in order, no schedule (nothing to overlap, no
        backward: the held-out loss), on every rank of the pipeline. Collective over the pp group."""
        from ddp_lab.pipeline_parallel.lab import Messages

        stages, pp, rank = self.mesh.pp * self.chunks, self.mesh.pp, self.mesh.pp_rank
        messages, value = Messages(self.mesh.pp_group, pp, stages, self.device), torch.zeros((), device=self.device)
        for stage in range(stages):
            if stage % pp != rank:
                continue
            x = inputs if stage == 0 else messages.recv_activation(0, stage)
            with precision.autocast():
                out = model(x, chunk=stage // pp)
            if stage < stages - 1:
                messages.send_activation(out, 0, stage)
            else:
                with loss.context():
                    value = loss(out.float(), targets).double()
        messages.finish_step()
        value = value.double()
        dist.broadcast(value, group=self.mesh.pp_group, group_src=(stages - 1) % pp)
        return value

    def pop(self) -> dict:
        """This step's figures of the pipeline, from the runner's clocks (each action's compute; the lab's also its
        receives' waits and its bytes sent), once. The bubble is of the pipeline's span, the longest stage rank's
        (the formula's, and the simulation's: a last stage that finished early idles until the first finishes its
        flush): one all-reduce over the pp group, after the step's timer stopped. Collective over the pp group."""
        figures, self.runner.figures = self.runner.figures, {}
        if not figures:
            return {}
        costs: dict[str, list[float]] = {}
        for kind, _, chunk, _, start, end in self.runner.timeline:
            costs.setdefault(f"{kind}{chunk}", []).append(end - start)
        span = torch.tensor(figures["span_s"], dtype=torch.float64, device=self.device)
        dist.all_reduce(span, op=dist.ReduceOp.MAX, group=self.mesh.pp_group)
        figures["span_s"] = float(span)
        self.per_step.append({**figures, "costs": costs})
        out = {PP_BUBBLE.key: 100 * (1 - figures["busy_s"] / figures["span_s"])}
        if "wait_s" in figures:
            out.update({PP_WAIT.key: figures["wait_s"] * 1e3, PP_P2P_BYTES.key: figures["sent_bytes"]})
        return out

    def describe(self, warmup_steps: int) -> dict:
        """The summary's pipeline: the schedule, its formula and its bubble simulated on paper, and per stage rank
        the measured bubble, compute, waits, bytes sent and activation peak (means over the measured steps), each
        action's mean compute (`action_ms`: `F0` the forward of chunk 0, ...; what analysis/pipeline.py replays
        the schedule with) and the last step's timeline. Collective over every rank (gathered)."""
        pp = self.mesh.pp
        simulated = simulate(self.schedule, pp, self.m, self.chunks)
        measured = self.per_step[warmup_steps:] or self.per_step
        saved = getattr(self.runner, "activations", None)  # the lab's count (torch's stages are not counted)
        mine = {"pp_rank": self.mesh.pp_rank, "timeline": self.runner.timeline,
                "activation_peak_bytes": None if saved is None else saved.peak,
                "activation_microbatch_bytes": None if saved is None else saved.largest}
        if measured:
            def mean(values):
                return sum(values) / len(values)

            pooled: dict[str, list[float]] = {}
            for f in measured:
                for key, values in f["costs"].items():
                    pooled.setdefault(key, []).extend(values)
            mine.update(bubble_pct=100 * mean([1 - f["busy_s"] / f["span_s"] for f in measured]),
                        busy_ms=1e3 * mean([f["busy_s"] for f in measured]),
                        span_ms=1e3 * mean([f["span_s"] for f in measured]),  # the pipeline's (pop)
                        action_ms={key: 1e3 * mean(values) for key, values in sorted(pooled.items())})
            if "wait_s" in measured[-1]:
                mine.update(wait_ms=1e3 * mean([f["wait_s"] for f in measured]), p2p_bytes=measured[-1]["sent_bytes"])
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        stages = {}
        for entry in everyone:  # one per pipeline rank (the first rank of each: its dp and tp peers alike)
            stages.setdefault(entry["pp_rank"], entry)
        per_stage = [stages[r] for r in range(pp)]
        formula = bubble_formula(self.schedule, pp, self.m, self.chunks)
        measured_mean = (sum(s["bubble_pct"] for s in per_stage) / pp) if measured else None
        return {"schedule": self.schedule, "impl": str(self.impl), "microbatches": self.m,
                "stages_per_rank": self.chunks, "stage_layers": [list(names) for names in self.layers],
                "bubble_formula_pct": None if formula is None else 100 * formula,
                "bubble_simulated_pct": 100 * simulated.bubble(),
                "bubble_measured_pct": measured_mean, "in_flight_peak": simulated.peak_in_flight,
                "per_stage": per_stage}
