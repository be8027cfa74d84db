"""`parallel.pp_impl=torch`: torch.distributed.pipelining's PipelineStage and schedules on the same stages, the
in-run reference for the lab's.

Each of the rank's chunks is a PipelineStage (its submodule a view of the rank's model that runs that chunk:
`ChunkView`), the schedule the one of the same name (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble). The loss is the lab's, divided by the micro-batch count once, so the schedule's
own scaling is off (`scale_grads=False`: with it, gradients would be divided by m twice). torch's stage knows
torch's DDP and FSDP2 but not the lab's strategies, so the whole schedule runs inside the strategy's `no_sync()`
after its `before_pipeline_step()`, and `finish_gradient_synchronization()` follows it: each strategy reduces the
micro-batches' sum once, after the schedule (the lab's schedules reduce during the last backward where a strategy
can). FSDP2's strategies (fsdp_torch, replicate_torch) turn gradient sync off for the whole step there and reduce
in `finish_gradient_synchronization()`, as torch's stage does for an FSDP2 module (`perform_reduce_grad`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.spec.pipeline import PPSchedule, stage_index

TORCH_SCHEDULES = {PPSchedule.gpipe: "ScheduleGPipe", PPSchedule.one_f_one_b: "Schedule1F1B",
                   PPSchedule.interleaved_1f1b: "ScheduleInterleaved1F1B",
                   PPSchedule.zero_bubble: "ScheduleInterleavedZeroBubble"}
MULTI_STAGE = (PPSchedule.interleaved_1f1b, PPSchedule.zero_bubble)


class ChunkView(nn.Module):
    """The rank's model (a strategy around the cut model) running one chunk; its parameters are that chunk's."""

    def __init__(self, model: nn.Module, chunk: int):
        super().__init__()
        object.__setattr__(self, "model", model)  # not a submodule: the parameters are the chunk's only
        self.chunk = chunk

    def forward(self, x):
        return self.model(x, chunk=self.chunk)

    def parameters(self, recurse: bool = True):
        module, seen = self.model.module, set()
        for name in module._pp_chunks[self.chunk]:
            for p in module.get_submodule(name).parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def named_parameters(self, *args, **kwargs):
        return ((str(i), p) for i, p in enumerate(self.parameters()))


class TorchPipeline:
    """torch's schedule over this rank's stages (module docstring)."""

    def __init__(self, mesh, schedule: str, microbatches: int, chunks: int, device: torch.device):
        self.mesh, self.schedule, self.m, self.chunks, self.device = mesh, schedule, microbatches, chunks, device
        self.stages = mesh.pp * chunks
        self.ties = None
        self.runner = None
        self.figures: dict = {}
        self.timeline: list = []  # (kind, micro-batch, chunk, asked, start, end): seconds from the step's start
        self.begin = 0.0

    def _build(self, model, precision, loss) -> None:
        from torch.distributed import pipelining
        from torch.distributed.pipelining import PipelineStage

        stages = [PipelineStage(ChunkView(model, c), stage_index(self.mesh.pp_rank, c, self.mesh.pp), self.stages,
                                self.device, group=self.mesh.pp_group) for c in range(self.chunks)]
        m = self.m

        def loss_fn(output, target):
            return precision.scaled(loss(output.float(), target) / m)

        for chunk, stage in enumerate(stages):
            self._clock(stage, chunk)
        cls = getattr(pipelining, TORCH_SCHEDULES[self.schedule])
        self.runner = cls(stages if self.schedule in MULTI_STAGE else stages[0], m, loss_fn=loss_fn,
                          scale_grads=False)
        self.first = any(s.is_first for s in stages)
        self.last = any(s.is_last for s in stages)

    def _clock(self, stage, chunk: int) -> None:
        """Time each action the schedule runs on `stage` (its forward, backward, and zero bubble's input and weight
        halves: I is a backward without the weights'), as the lab's clocks its own: the step's compute and timeline.
        The schedule's sends, receives and loss are outside them (the last stage's F here excludes its loss)."""
        def timed(method, kind_of):
            def run(chunk_id, *args, **kwargs):
                start = time.perf_counter()
                try:
                    return method(chunk_id, *args, **kwargs)
                finally:
                    end = time.perf_counter() - self.begin
                    start -= self.begin
                    self.timeline.append((kind_of(kwargs), chunk_id, chunk, start, start, end))
            return run

        stage.forward_one_chunk = timed(stage.forward_one_chunk, lambda kw: "F")
        stage.backward_one_chunk = timed(stage.backward_one_chunk,
                                         lambda kw: "B" if kw.get("full_backward", True) else "I")
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, lambda kw: "W")

    def step(self, model, optimizer, micro_batches: list, timer=None, before_step=None, set_to_none: bool = True,
             precision=None, loss=None) -> torch.Tensor:
        from ddp_lab.rank.step import finish_step

        if self.runner is None:
            self._build(model, precision, loss)
        lap = timer.lap if timer is not None else (lambda phase: None)
        optimizer.zero_grad(set_to_none=set_to_none)
        model.grad_scale = precision.grad_scale
        inputs = torch.cat([x for x, _ in micro_batches])
        targets = torch.cat([y for _, y in micro_batches])
        losses: list = []
        self.timeline, self.begin = [], time.perf_counter()
        model.before_pipeline_step()
        with model.no_sync(), loss.context(), precision.autocast():
            self.runner.step(*([inputs] if self.first else []), target=targets if self.last else None,
                             losses=losses if self.last else None)
        self.figures = {"busy_s": sum(end - start for *_, start, end in self.timeline),
                        "span_s": time.perf_counter() - self.begin}
        total = (torch.stack([v.detach() for v in losses]).sum() / precision.grad_scale if losses
                 else torch.zeros((), device=self.device))  # the losses came scaled (fp16)
        finish_step(lambda: self.ties.synchronize(model), optimizer, lap, before_step, precision)
        dist.broadcast(total, group=self.mesh.pp_group, group_src=(self.stages - 1) % self.mesh.pp)
        return total
