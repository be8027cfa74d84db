"""An expert-parallel mixture of experts as a student writes one for the course's fourth axis, to the contract of
docs/check_ep.md (`MoE(d_model, d_ff, num_experts, top_k, group)`, forward -> (output, balancing loss)), and one
wrong version per cause the check names (`python -m ddp_lab.check tests.helpers.course_moe.MoE --ep 2,4`;
tests/e2e/test_check_ep.py). Written apart from the lab's own layer (ddp_lab/models/moe.py): a ModuleList of GELU
experts, rows exchanged by hand, the balancing loss the Switch Transformer's."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class AllToAll(torch.autograd.Function):
    """Rows `send[r]` to rank r, `receive[r]` from it; backward sends each row's gradient back where it came from."""

    @staticmethod
    def forward(ctx, x, send, receive, group):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _all_to_all(x, send, receive, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def _all_to_all(x, send, receive, group):
    out = x.new_empty((sum(receive), x.shape[1]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=receive, input_split_sizes=send, group=group)
    return out


class Expert(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.up, self.down = nn.Linear(d_model, d_ff, bias=False), nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Right: this rank's run of `num_experts / ep` experts, the gate whole; each token's rows go to their experts'
    ranks and back, and its output is the scores-weighted sum of its `top_k` experts' outputs."""

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int, group=None,
                 score_func: str = "softmax", aux_coeff: float = 0.01):
        super().__init__()
        self.group, self.ep, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        if num_experts % self.ep:
            raise ValueError(f"num_experts {num_experts} is not divisible by the {self.ep} expert-parallel ranks")
        self.num_experts, self.top_k, self.score_func, self.aux_coeff = num_experts, top_k, score_func, aux_coeff
        self.local = num_experts // self.ep
        self.gate = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, d_ff) for _ in range(self.local))

    def route(self, x):
        """(scores (tokens, experts), chosen (tokens, top_k), their weights)."""
        logits = self.gate(x)
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        weights, chosen = scores.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        return scores, chosen, weights

    def balance(self, scores, chosen):
        """The Switch Transformer's loss over every rank's tokens, this rank's share of it times ep (the mean of the
        ranks' values is the loss): the counts summed over the ranks, the probabilities this rank's."""
        counted = torch.cat([torch.bincount(chosen.flatten(), minlength=self.num_experts).to(scores.dtype),
                             torch.tensor([float(scores.shape[0])], dtype=scores.dtype)])
        dist.all_reduce(counted, group=self.group)
        share = counted[:-1] / (counted[-1] * self.top_k)
        probability = scores.sum(0) / counted[-1]
        return self.aux_coeff * self.num_experts * (share * probability).sum() * self.ep

    def exchange_counts(self, counts):
        """(ep, local experts): the rows every rank sends to each of this rank's experts."""
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        return received.view(self.ep, self.local)

    def send(self, x, send, receive):
        return AllToAll.apply(x, send, receive, self.group)

    def run_experts(self, arrived, received):
        """Rows arrive rank-major (rank 0's for my expert 0, 1, ..., then rank 1's): put them expert-major, run each
        expert on its rows, and put the outputs back rank-major."""
        sizes = received.flatten().tolist()
        chunks = list(arrived.split(sizes))
        order = [r * self.local + e for e in range(self.local) for r in range(self.ep)]
        outs = {}
        for e in range(self.local):
            rows = [order[i] for i in range(e * self.ep, (e + 1) * self.ep)]
            taken = torch.cat([chunks[i] for i in rows])
            done = self.experts[e](taken).split([sizes[i] for i in rows])
            outs.update(zip(rows, done))
        return self.back(outs, len(sizes))

    def back(self, outs, n):
        return torch.cat([outs[i] for i in range(n)])

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        scores, chosen, weights = self.route(tokens)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        rows = torch.arange(tokens.shape[0]).repeat_interleave(self.top_k)[order]
        counts = torch.bincount(flat, minlength=self.num_experts)
        received = self.exchange_counts(counts)
        send, receive = counts.view(self.ep, self.local).sum(1).tolist(), received.sum(1).tolist()
        arrived = self.send(tokens[rows], send, receive)
        out = self.send(self.run_experts(arrived, received), receive, send)
        y = self.combine(tokens, rows, out * self.combine_weights(weights.flatten()[order]))
        return y.view(shape), self.balance(scores, chosen)

    def combine(self, tokens, rows, weighted):
        """Each token's weighted rows summed into its output (a token may get several: index_add sums repeats)."""
        return torch.zeros_like(tokens).index_add(0, rows, weighted)

    def combine_weights(self, weights):
        return weights.unsqueeze(-1)


# --- one bug each --------------------------------------------------------------------------------------------


class NoAutogradExchange(MoE):
    """The rows sent by a plain all_to_all_single outside autograd: the forward is bit for bit right, no expert
    trains (its gradient is None) and the input gets no gradient through the experts."""

    def send(self, x, send, receive):
        return _all_to_all(x.detach(), send, receive, self.group)


class DetachedGates(MoE):
    """The combine's weights detached: the router learns from the balancing loss only."""

    def combine_weights(self, weights):
        return weights.detach().unsqueeze(-1)


class ScoresNeverApplied(MoE):
    """Each expert's output summed unweighted: the router gets no gradient through the combine either."""

    def combine_weights(self, weights):
        return torch.ones_like(weights).unsqueeze(-1)


class PerRankBalance(MoE):
    """The balancing loss over this rank's own tokens (its counts never summed over the ranks)."""

    def balance(self, scores, chosen):
        share = torch.bincount(chosen.flatten(), minlength=self.num_experts).to(scores.dtype) / chosen.numel()
        return self.aux_coeff * self.num_experts * (share * scores.mean(0)).sum()


class CountsNotExchanged(MoE):
    """Sizes its receive buffer as if every rank sent what it sends (no exchange of the counts): on an uneven load
    it receives fewer rows than the buffer holds (the rest is whatever memory held) or more (gloo aborts the rank)."""

    def exchange_counts(self, counts):
        mine = counts.view(self.ep, self.local)[self.rank]
        return mine.expand(self.ep, self.local).clone()


class WrongInverse(MoE):
    """Puts the outputs back in expert-major order (the permutation applied again, not undone): each row goes home
    to the wrong token as soon as two ranks send one expert rows."""

    def back(self, outs, n):
        order = [r * self.local + e for e in range(self.local) for r in range(self.ep)]
        return torch.cat([outs[i] for i in order])


class ExpertGradientsTimesEp(MoE):
    """Multiplies the gradient reaching its experts' outputs by ep, to undo a data-parallel average the experts never
    get (their gradient already sums every rank's tokens): every expert's gradient is ep times one process's."""

    def run_experts(self, arrived, received):
        return _Scale.apply(super().run_experts(arrived, received), self.ep)


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class IndexedPlusEquals(MoE):
    """Adds each rank's returned rows to their tokens with an indexed `+=`, one rank's rows at a time (as a public
    expert-parallel layer does): where a token's two rows came back from one rank, one write wins and an expert's
    output is lost. Which tokens lose one depends on where their experts live, so ep changes the output; right at
    top-1, where no token repeats."""

    def combine(self, tokens, rows, weighted):
        y = torch.zeros_like(tokens)
        per_rank = self.sent_per_rank
        for r_rows, r_weighted in zip(rows.split(per_rank), weighted.split(per_rank)):
            y[r_rows] += r_weighted
        return y

    def exchange_counts(self, counts):
        self.sent_per_rank = counts.view(self.ep, self.local).sum(1).tolist()
        return super().exchange_counts(counts)


class SkipsAnEmptyExchange(MoE):
    """Returns early when none of its experts got a row, skipping the combine's all-to-all the other ranks wait in."""

    def forward(self, x):
        scores, chosen, weights = self.route(x.reshape(-1, x.shape[-1]))
        received = self.exchange_counts(torch.bincount(chosen.flatten(), minlength=self.num_experts))
        if int(received.sum()) == 0:
            return torch.zeros_like(x), self.balance(scores, chosen)
        return super().forward(x)
