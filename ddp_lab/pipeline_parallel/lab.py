"""`parallel.pp_impl=lab`: a schedule's actions (spec/pipeline.py) run by hand over point-to-point sends and
receives on the mesh's `pp` group.

Per action: F receives the micro-batch's activation from the previous stage (the first stage takes its tokens),
runs this rank's chunk, and sends the output on (the last stage computes the micro-batch's loss, divided by the
micro-batch count once, so the step's gradients are the mean over the global batch whatever the schedule); B
receives the output's gradient from the next stage, runs backward, and sends the input's gradient back; I and W
(zero bubble) are B's two halves, the input's gradient first and sent on at once, the weights' later (torch's
autograd split of a backward, `stage_backward_input`, keeps what W needs; W is torch's `stage_backward_weight`, a
backward per weight, except on a stage whose blocks are checkpointed, where each of those backwards would recompute
the block: there W is one backward, `backward_weights_at_once`; the order is the lab's). Sends are asynchronous
and waited for at the end of the step; a receive blocks, and its wait is timed. Messages are tagged by micro-batch,
stage and direction; an activation's shape and dtype cross each stage boundary once, as a header before the first.

Data parallelism on the stage: every forward and every backward but the rank's last runs inside the strategy's
`no_sync()`; the last runs outside it, and `finish_gradient_synchronization()` follows the schedule, so each
strategy reduces the sum of the micro-batches' gradients once, over its stage's dp group. FSDP2's strategies turn
sync off for the whole step in `before_pipeline_step()` and reduce after the schedule. A weight tied across stages
keeps the last backward under `no_sync()` too, where its copies are summed before the reduction
(stages.TiedAcrossStages).

Each step is clocked per action: the compute (what the bubble is not), the waits for a receive, and the
timeline of the last step; on the first step the activations autograd saves are counted per micro-batch, and the
most alive at once is the stage's activation peak.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, stage_backward_input, stage_backward_weight

from ddp_lab.rank.activations import SavedActivations
from ddp_lab.rank.recompute import recomputes
from ddp_lab.spec.pipeline import schedule_actions, stage_index
from ddp_lab.units import tensor_bytes

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
HEADER = 8  # ndim, dtype, and up to 6 dimensions
HEADER_TAG = 1 << 30  # above every micro-batch's tags


class Messages:
    """Activations forward and gradients backward between neighbouring stages (module docstring)."""

    def __init__(self, group, pp: int, stages: int, device: torch.device):
        self.group, self.pp, self.stages, self.device = group, pp, stages, device
        self.told: set[int] = set()      # stage boundaries whose header went out
        self.known: dict[int, tuple] = {}  # stage -> the (shape, dtype) its input arrives in
        self.sends: list = []
        self.sent_bytes = 0
        self.wait_s = 0.0

    def _tag(self, microbatch: int, stage: int, backward: bool) -> int:
        return 2 * (microbatch * self.stages + stage) + int(backward)

    def _send(self, tensor: torch.Tensor, to_stage: int, tag: int) -> None:
        tensor = tensor.contiguous()
        self.sends.append(dist.isend(tensor, group=self.group, group_dst=to_stage % self.pp, tag=tag))
        self.sent_bytes += tensor_bytes(tensor)

    def _recv(self, like: torch.Tensor, from_stage: int, tag: int) -> torch.Tensor:
        start = time.perf_counter()
        dist.irecv(like, group=self.group, group_src=from_stage % self.pp, tag=tag).wait()
        self.wait_s += time.perf_counter() - start
        return like

    def send_activation(self, out: torch.Tensor, microbatch: int, stage: int) -> None:
        if stage not in self.told:
            header = torch.zeros(HEADER, dtype=torch.int64, device=self.device)
            header[0], header[1] = out.dim(), DTYPES.index(out.dtype)
            header[2:2 + out.dim()] = torch.tensor(out.shape)
            self._send(header, stage + 1, HEADER_TAG + stage + 1)
            self.told.add(stage)
        self._send(out.detach(), stage + 1, self._tag(microbatch, stage + 1, False))

    def recv_activation(self, microbatch: int, stage: int) -> torch.Tensor:
        if stage not in self.known:
            header = self._recv(torch.zeros(HEADER, dtype=torch.int64, device=self.device), stage - 1,
                                HEADER_TAG + stage)
            ndim = int(header[0])
            self.known[stage] = (tuple(int(d) for d in header[2:2 + ndim]), DTYPES[int(header[1])])
        shape, dtype = self.known[stage]
        x = self._recv(torch.empty(shape, dtype=dtype, device=self.device), stage - 1, self._tag(microbatch, stage,
                                                                                                    False))
        return x.requires_grad_()

    def send_gradient(self, grad: torch.Tensor, microbatch: int, stage: int) -> None:
        self._send(grad, stage - 1, self._tag(microbatch, stage - 1, True))

    def recv_gradient(self, like: torch.Tensor, microbatch: int, stage: int) -> torch.Tensor:
        return self._recv(torch.empty_like(like), stage + 1, self._tag(microbatch, stage, True))

    def finish_step(self) -> dict:
        """Wait for every send of the step; its bytes and waits, then start afresh."""
        for work in self.sends:
            work.wait()
        out = {"sent_bytes": self.sent_bytes, "wait_s": self.wait_s}
        self.sends, self.sent_bytes, self.wait_s = [], 0, 0.0
        return out


def backward_weights_at_once(weights: list, param_groups: list[dict]) -> None:
    """W: the weights' gradients from what `stage_backward_input` kept, in one backward over every parameter group.

    torch's `stage_backward_weight` runs one backward per group, and under activation checkpointing each backward
    recomputes the checkpointed block again: 7 forwards of a block of the lab's Transformer in one W (a group per
    weight), where this runs 1. Each group's intermediates get the gradient they received in I (a pre-hook replaces
    what flows in, as torch clamps within a group), so a node below several is not counted twice; each weight's
    gradient is accumulated as torch's does. The price: autograd runs the input's path between the groups again
    (its result replaced by the pre-hooks), so without a recompute to save it is the slower one (a W of model=tiny's
    last 2 blocks at context 128: 101 to 104 ms here, torch's 44 to 45; with full checkpointing 123 to 127 against
    225 to 238)."""
    by_node = {_get_grad_fn_or_grad_acc(w): w for w in weights}
    edges, grads, accumulators, handles = [], [], [], []
    try:
        for group in param_groups:
            for saved, node in zip(group["grads"], group["intermediates"]):
                handles.append(node.register_prehook(lambda grad_outputs, saved=saved: saved))
                for i, grad in enumerate(saved):
                    if grad is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(grad)
            accumulators.extend(group["params"])
        dweights = torch.autograd.grad(edges, [GradientEdge(a, 0) for a in accumulators], grad_outputs=grads) \
            if edges else ()
    finally:
        for handle in handles:
            handle.remove()
        for group in param_groups:  # the hooks' closures and the nodes they sit on: no cycle left behind
            group.pop("intermediates", None)
            group.pop("grads", None)
    for accumulator, dw in zip(accumulators, dweights):
        weight = by_node[accumulator]
        if weight.grad is None:
            weight.grad = dw
        else:
            weight.grad += dw


def weights_pass(module):
    """W's arithmetic for a stage (module docstring): one backward where its blocks are checkpointed, else torch's,
    one per weight (`backward_weights_at_once` says what each costs)."""
    if recomputes(module):
        return backward_weights_at_once
    return lambda weights, groups: stage_backward_weight(iter(weights), groups)


class LabPipeline:
    """This rank's part of the schedule, run by hand (module docstring)."""

    def __init__(self, mesh, schedule: str, microbatches: int, chunks: int, device: torch.device):
        self.pp, self.rank, self.chunks, self.m = mesh.pp, mesh.pp_rank, chunks, microbatches
        self.stages = self.pp * chunks
        self.group = mesh.pp_group
        self.actions = schedule_actions(schedule, self.pp, microbatches, self.rank, chunks)
        backward = [i for i, a in enumerate(self.actions) if a.kind in ("B", "W")]
        self.last_backward = backward[-1]
        self.messages = Messages(self.group, self.pp, self.stages, device)
        self.ties = None  # stages.TiedAcrossStages: set by Pipeline.cut
        self.steps = 0
        self.activations: SavedActivations | None = None
        self.figures: dict = {}
        self.timeline: list = []

    def _chunk_params(self, module, chunk: int) -> list:
        seen, out = set(), []
        for name in module._pp_chunks[chunk]:
            for p in module.get_submodule(name).parameters():
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    out.append(p)
        return out

    def step(self, model, optimizer, micro_batches: list, timer=None, before_step=None, set_to_none: bool = True,
             precision=None, loss=None) -> torch.Tensor:
        """One optimizer step of the schedule over this rank's micro-batches; the mean loss over them (the last
        stage's, on every rank of the pipeline)."""
        from ddp_lab.rank.step import finish_step

        lap = timer.lap if timer is not None else (lambda phase: None)
        optimizer.zero_grad(set_to_none=set_to_none)
        model.grad_scale = precision.grad_scale
        counting = self.steps == 0
        if counting:
            self.activations = SavedActivations()
        model.before_pipeline_step()
        saved, weights, losses, timeline = {}, {}, [], []
        begin, busy = time.perf_counter(), 0.0
        for index, act in enumerate(self.actions):
            s = stage_index(self.rank, act.chunk, self.pp)
            first, last, key = s == 0, s == self.stages - 1, (act.microbatch, act.chunk)
            inputs, targets = micro_batches[act.microbatch]
            ask = time.perf_counter()
            if act.kind == "F":
                x = inputs if first else self.messages.recv_activation(act.microbatch, s)
                start = time.perf_counter()
                hooks, done = self.activations.counting(key) if counting else (nullcontext(), None)
                with model.no_sync(), hooks:
                    with precision.autocast():
                        out = model(x, chunk=act.chunk)
                    if last:  # what the loss saves (its log-softmax, the logits' size) is the stage's too
                        with loss.context():
                            out = loss(out.float(), targets) / len(micro_batches)
                if last:
                    losses.append(out.detach())
                if done is not None:
                    done()
                if not last:
                    self.messages.send_activation(out, act.microbatch, s)
                saved[key] = (x, out)
            else:
                start = self._backward(act, index, s, first, last, key, model, saved, weights, precision, loss)
            end = time.perf_counter()
            busy += end - start
            timeline.append((act.kind, act.microbatch, act.chunk, ask - begin, start - begin, end - begin))
        sent = self.messages.finish_step()
        span = time.perf_counter() - begin
        finish_step(lambda: self.ties.synchronize(model), optimizer, lap, before_step, precision)
        self.steps += 1
        self.timeline = timeline
        self.figures = {"busy_s": busy, "span_s": span, **sent}
        total = torch.stack(losses).sum() if losses else torch.zeros((), device=self.messages.device)
        dist.broadcast(total, group=self.group, group_src=(self.stages - 1) % self.pp)
        return total

    def _backward(self, act, index, s, first, last, key, model, saved, weights, precision, loss) -> float:
        """B, I or W of one micro-batch on one chunk (module docstring); when its compute began."""
        sync = index == self.last_backward and not self.ties.sum_first(model)
        if act.kind == "W":
            start = time.perf_counter()
            x, out, grad, groups = weights.pop(key)
            with nullcontext() if sync else model.no_sync():
                if groups is None:  # the first stage: its I had no input to give a gradient to
                    torch.autograd.backward(out, grad)
                else:
                    weights_pass(model.module)(self._chunk_params(model.module, act.chunk), groups)
            if self.activations is not None:
                self.activations.freed(key)
            return start
        x, out = saved.pop(key)
        grad = None if last else self.messages.recv_gradient(out, act.microbatch, s)
        start = time.perf_counter()
        with loss.context() if last else nullcontext():
            root = precision.scaled(out) if last else out
            if act.kind == "B":
                with nullcontext() if sync else model.no_sync():
                    torch.autograd.backward(root, grad)
                given = None if first else x.grad
            elif first:  # I on the first stage: nothing to send; W runs the whole backward
                weights[key] = (x, root, grad, None)
                return start
            else:
                params = self._chunk_params(model.module, act.chunk)
                grads, groups = stage_backward_input([root], None if grad is None else [grad], [x], iter(params))
                weights[key] = (x, root, grad, groups)
                given = grads[0]
        if given is not None:
            self.messages.send_gradient(given, act.microbatch, s)
        if act.kind == "B" and self.activations is not None:
            self.activations.freed(key)
        return start
