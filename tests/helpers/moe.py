"""Mixtures of experts for the expert-parallel tests: a test-sized MoE Transformer, the one-process reference's
set-up, and the traps (each a version of the exchange or the router with one known bug) the proofs must catch."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from ddp_lab.check.models import CONTEXT, VOCAB
from ddp_lab.expert_parallel import EXPERT_TENSORS
from ddp_lab.expert_parallel.exchange import LabExchange, Tally
from ddp_lab.expert_parallel.torch_exchange import TorchExchange
from ddp_lab.models.moe import MoE, MoETransformer

EXPERTS = 4


def tiny_moe(**knobs):
    """A 2-block MoE Transformer small enough for a parity test: 4 experts, top-2, width 32 (every size a multiple
    of 4, as torch._grouped_mm needs)."""
    def build():
        options = {"experts": EXPERTS, "top_k": 2, "expert_d_ff": 16, "balance": "aux_loss", **knobs}
        return MoETransformer(vocab_size=VOCAB, context_length=CONTEXT, d_model=32, num_layers=2, num_heads=4,
                              **options)
    return build


# --- the traps: each replaces one part with a version carrying one known bug ----------------------------------


def detached_gates(layer) -> None:
    """The combine's weights detached from the router: the router gets no gradient through the combine."""
    forward = layer.router.forward

    def detached(x):
        probabilities, chosen, weights = forward(x)
        return probabilities, chosen, weights.detach()
    layer.router.forward = detached


def per_rank_balance(layer) -> None:
    """The balancing loss over this rank's tokens only (its counts never summed over the ranks)."""
    layer.sum_over_replicas = None


def scores_twice(layer) -> None:
    """The scores applied twice (once before the experts, once in the combine): each output weighted by its score
    squared."""
    forward = layer.router.forward

    def twice(x):
        probabilities, chosen, weights = forward(x)
        return probabilities, chosen, weights * weights
    layer.router.forward = twice


def wrong_inverse(exchange_object) -> None:
    """The lab's exchange with the permutation applied again on the way back instead of its inverse."""
    from ddp_lab.expert_parallel import exchange as module

    def call(x, counts, experts):
        ep, group, tally = exchange_object.ep, exchange_object.group, exchange_object.tally
        received = module.exchange_counts(counts, ep, group, tally)
        send = counts.view(exchange_object.ep, -1).sum(1).tolist()
        receive = received.sum(1).tolist()
        arrived = module.AllToAll.apply(x, send, receive, exchange_object.group, exchange_object.tally, "dispatch")
        order = module.expert_major(received)
        out = experts(arrived[order], received.sum(0).tolist())
        return module.AllToAll.apply(out[order], receive, send, exchange_object.group, exchange_object.tally,
                                     "combine")
    return call


def no_autograd_exchange(exchange_object) -> None:
    """The lab's exchange through a plain all-to-all, outside autograd: the forward is right, no expert trains."""
    from ddp_lab.expert_parallel import exchange as module

    def send(x, send_, receive):
        out = x.new_empty((sum(receive), *x.shape[1:]))
        dist.all_to_all_single(out, x.detach().contiguous(), output_split_sizes=receive, input_split_sizes=send_,
                               group=exchange_object.group)
        return out

    def call(x, counts, experts):
        ep, group, tally = exchange_object.ep, exchange_object.group, exchange_object.tally
        received = module.exchange_counts(counts, ep, group, tally)
        s, r = counts.view(exchange_object.ep, -1).sum(1).tolist(), received.sum(1).tolist()
        order = module.expert_major(received)
        out = experts(send(x, s, r)[order], received.sum(0).tolist())
        return send(out[torch.argsort(order)], r, s)
    return call


class LabMoE(MoE):
    """The lab's own mixture layer under `ddp_lab.check --ep`'s contract (docs/check_ep.md): built from sizes and its
    ep group, its stacked experts cut to this rank's run, the lab's exchange over the group, its balancing loss
    summed over the group and returned beside the output. The user-facing check passing it, as the parity suite does,
    holds the check's stacked-expert path to the lab's layer."""

    exchange_class = LabExchange

    def __init__(self, d_model: int, expert_d_ff: int, experts: int, top_k: int, group, router: str = "softmax"):
        super().__init__(d_model, experts, top_k, expert_d_ff, router=router, balance="aux_loss")
        ep, index = dist.get_world_size(group), dist.get_rank(group)
        share = experts // ep
        for name in EXPERT_TENSORS:
            whole = getattr(self.experts, name).data
            setattr(self.experts, name, torch.nn.Parameter(whole[index * share:(index + 1) * share].clone()))
        self.experts.first = index * share
        self.exchange = self.exchange_class(ep, group, Tally())
        self.sum_over_replicas = partial(dist.all_reduce, group=group)
        self.replicas = ep

    def forward(self, x):
        return super().forward(x), self.pop_aux()


class TorchPartsMoE(LabMoE):
    """LabMoE with torch's parts for the trip (parallel.ep_impl=torch: torch._grouped_mm, which refuses float64):
    checked with `--dtype float32`."""

    exchange_class = TorchExchange
