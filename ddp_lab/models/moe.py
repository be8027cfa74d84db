"""A mixture of experts in place of each block's feed-forward: the lab's Transformer as DeepSeek-V3, Qwen3 and
Mixtral lay it out (`model=tiny_moe`, `small_moe`).

Each token's router scores pick `top_k` of `experts` SwiGLU experts; the token goes to each, and their outputs come
back weighted by the scores (applied once, after the experts, in at least fp32) and summed. The forward is written
so that expert parallelism changes one step only: the tokens are sorted by expert and handed, with the count per
expert, to `exchange(tokens, counts, experts)`, which returns each row's expert output in the same order. On one
process that runs the experts here (`local_exchange`); under `parallel.ep` the expert-parallel axis
(ddp_lab/expert_parallel/) replaces it with one that sends each row to the rank holding its expert and back.

Balancing (`balance`):
- `aux_loss`: the Switch Transformer's loss, experts x sum_i f_i P_i, over the global batch: f_i (the share of
  routed slots that chose expert i) from counts summed over every data-parallel rank, P_i (the mean router
  probability of expert i) over every rank's tokens. Each rank adds its tokens' share, scaled so that the
  strategy's mean over the ranks is the global loss's gradient (a per-rank loss differs from it, by a little);
  its value is left out of the logged loss (`CrossEntropy` plus a term whose value is zero and whose gradient is
  the balancing loss's), kept in the step's figures instead.
- `bias`: DeepSeek-V3's aux-loss-free balancing: a per-expert bias added to the scores for the choice only (the
  weights stay the scores), moved after each optimizer step by `bias_rate` x sign(mean load - load), the loads
  summed over the step's forwards and every data-parallel rank (`after_optimizer_step`), so every rank holds the
  same bias.
- `none`.

`capacity_factor`: None is dropless; a number caps each expert at ceil(factor x tokens x top_k / experts) slots per
group of tokens, the first tokens first, the rest dropped (their slot contributes nothing). The group is a rank's
own tokens, as Megatron and DeepSpeed compute it; one process matches a layout only with `capacity_groups` set to
its data-parallel ranks.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from ddp_lab.models.recomputing import recomputing
from ddp_lab.models.transformer import SwiGLU, Transformer
from ddp_lab.spec.figures import MOE_AUX, MOE_BUSIEST, MOE_DROPPED, MOE_MAX_OVER_MEAN


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32 where it is narrower (bf16, fp16), as it is otherwise (float32, float64)."""
    return x.float() if x.element_size() < 4 else x


class Router(nn.Module):
    """Scores (softmax, or sigmoid as DeepSeek-V3) of every expert for every token, in at least fp32, and the
    `top_k` chosen by score plus a selection-only bias (frozen: zeros unless balance=bias moves it)."""

    def __init__(self, d_model: int, experts: int, top_k: int, score: str):
        super().__init__()
        self.gate = nn.Linear(d_model, experts, bias=False)
        # A parameter no gradient reaches (not a buffer): state a checkpoint keeps, a strategy broadcasts, no optimizer
        # steps; balance=bias moves it after each step.
        self.selection_bias = nn.Parameter(torch.zeros(experts), requires_grad=False)
        self.top_k, self.score = top_k, score

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probabilities (tokens, experts) summing to 1 per token, chosen experts (tokens, top_k), their weights)."""
        with torch.autocast(x.device.type, enabled=False) if x.device.type != "meta" else nullcontext():
            logits = F.linear(at_least_fp32(x), at_least_fp32(self.gate.weight))
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        chosen = (scores.detach() + self.selection_bias.to(scores.dtype)).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.top_k > 1:  # top-1 keeps its raw score, or the router would get no gradient through the combine
            weights = weights / weights.sum(-1, keepdim=True)
        probabilities = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        return probabilities, chosen, weights


class Experts(nn.Module):
    """`experts` SwiGLU experts as three stacked weights, (experts, d_model, d_ff), (experts, d_ff, d_model) and
    (experts, d_model, d_ff) for w1, w2 and w3. Under expert parallelism a rank keeps a run of them (`first` is the
    global index of its first); `expert_parallel` marks these parameters for the replica map."""

    expert_parallel = True

    def __init__(self, experts: int, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, d_model, d_ff))
        self.w2 = nn.Parameter(torch.empty(experts, d_ff, d_model))
        self.w3 = nn.Parameter(torch.empty(experts, d_model, d_ff))
        self.first = 0
        for w in (self.w1, self.w2, self.w3):  # each expert as the dense model's nn.Linear of the same shape
            std = 1 / math.sqrt(w.shape[1])
            nn.init.trunc_normal_(w, std=std, a=-3 * std, b=3 * std)

    @property
    def count(self) -> int:
        """The experts this module holds."""
        return self.w1.shape[0]

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`x`: rows grouped by expert, `counts[e]` rows for this module's expert e, in order. One matmul chain per
        expert (any dtype, float64 included); an expert with no rows still joins the graph, so its gradient is
        zeros, never None."""
        outs = []
        for e, rows in enumerate(x.split(counts)):
            w1, w2, w3 = (w[e].to(rows.dtype) for w in (self.w1, self.w2, self.w3))
            outs.append((F.silu(rows @ w1) * (rows @ w3)) @ w2)
        return torch.cat(outs)


def local_exchange(x: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
    """One process holds every expert: run them on the sorted rows."""
    return experts(x, counts.tolist())


class MoE(nn.Module):
    """The mixture in place of a block's SwiGLU; the module docstring says what each knob does."""

    once_a_forward = True  # its balancing counts the load once a forward: not again in a recompute (rank/recompute.py)

    def __init__(self, d_model: int, experts: int, top_k: int, expert_d_ff: int, shared_experts: int = 0,
                 router: str = "softmax", balance: str = "aux_loss", balance_coeff: float = 0.01,
                 capacity_factor: float | None = None, bias_rate: float = 1e-3):
        super().__init__()
        self.router = Router(d_model, experts, top_k, router)
        self.experts = Experts(experts, d_model, expert_d_ff)
        self.shared = SwiGLU(d_model, expert_d_ff) if shared_experts else None
        self.num_experts, self.top_k, self.balance = experts, top_k, balance
        self.balance_coeff, self.capacity_factor, self.bias_rate = balance_coeff, capacity_factor, bias_rate
        self.exchange = local_exchange
        """(rows sorted by expert, count per expert, experts) -> their outputs: replaced under expert parallelism."""
        self.sum_over_replicas = None
        """A callable summing a tensor over the data-parallel ranks (dp x cp) in place (the loads the balancing reads
        are the global batch's): set by ddp_lab/parallel/ where there are several; None: one process."""
        self.replicas = 1
        """The data-parallel ranks whose mean the strategy takes (dp x cp)."""
        self.capacity_groups = 1
        """Groups of consecutive tokens capacity is applied to, each on its own: 1 under a mesh (a rank's tokens); a
        one-process reference of a layout sets its data-parallel ranks."""
        self.aux: torch.Tensor | None = None  # the balancing term of the last training forward, for the loss
        self.step_load = torch.zeros(experts, dtype=torch.float64)  # slots chosen per expert since the last step
        self.figures: dict = {}  # the last forward's load and drops, for the step's figures
        self.chosen: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probabilities, chosen, weights = self.router(tokens)
        if tokens.is_meta:  # counted on the meta device (models/facts.py), routing has no data: an even load
            chosen = (torch.arange(chosen.numel()) % self.num_experts).view(chosen.shape)
        slot_token = torch.arange(tokens.shape[0], device=chosen.device).repeat_interleave(self.top_k)
        slot_expert, slot_weight = chosen.flatten(), weights.flatten()
        load = torch.bincount(slot_expert, minlength=self.num_experts)  # chosen, before any drop
        kept = self._within_capacity(chosen)
        if kept is not None:
            slot_token, slot_expert, slot_weight = slot_token[kept], slot_expert[kept], slot_weight[kept.to(x.device)]
        order = torch.argsort(slot_expert, stable=True)
        counts = torch.bincount(slot_expert, minlength=self.num_experts)
        rows = slot_token[order].to(x.device)
        out = self.exchange(tokens[rows], counts, self.experts)
        weighted = at_least_fp32(out) * slot_weight[order.to(x.device)].unsqueeze(-1)  # the scores, applied once
        combined = torch.zeros(tokens.shape[0], tokens.shape[1], dtype=weighted.dtype, device=x.device)
        combined = combined.index_add(0, rows, weighted).to(x.dtype)
        if self.shared is not None:
            combined = combined + self.shared(tokens)
        if self.training and torch.is_grad_enabled() and not tokens.is_meta:
            self._balance(probabilities, load, tokens.shape[0])
        self.chosen = chosen.detach()  # each token's experts, for the proofs that routing is the same on every layout
        dropped = 0 if kept is None else int((~kept).sum())
        self.figures = {"load": load.detach().cpu(), "dropped": dropped, "slots": int(slot_expert.numel()) + dropped}
        return combined.view_as(x)

    def _within_capacity(self, chosen: torch.Tensor) -> torch.Tensor | None:
        """Which (token, slot) pairs fit their expert's capacity (flattened, token-major), the first tokens first,
        per group of `capacity_groups`; None when dropless."""
        if self.capacity_factor is None:
            return None
        groups = chosen.view(self.capacity_groups, -1, self.top_k)
        per_group = groups.shape[1]
        capacity = math.ceil(self.capacity_factor * per_group * self.top_k / self.num_experts)
        onehot = F.one_hot(groups.flatten(1), self.num_experts)  # (groups, slots, experts)
        position = (onehot.cumsum(1) - 1).gather(-1, groups.flatten(1).unsqueeze(-1)).squeeze(-1)
        return (position < capacity).flatten()

    def _balance(self, probabilities: torch.Tensor, load: torch.Tensor, tokens: int) -> None:
        """This forward's balancing: the aux loss's term for this rank, or the load for the bias's next move. A
        checkpointed block's recompute (rank/recompute.py) computes the term again, as backward needs what it saved,
        but neither counts the load again nor hands the loss a second term."""
        again = recomputing()
        if self.balance == "bias" and not again:
            self.step_load += load.detach().cpu().double()
        if self.balance != "aux_loss":
            return
        counted = torch.cat([load.detach().double(), torch.tensor([float(tokens)], device=load.device,
                                                                  dtype=torch.float64)])
        if self.sum_over_replicas is not None:
            self.sum_over_replicas(counted)
        share = (counted[:-1] / (counted[-1] * self.top_k)).to(probabilities.dtype)  # f_i, the global batch's
        mean_probability = probabilities.sum(0) / counted[-1].to(probabilities.dtype)  # this rank's part of P_i
        # Times the ranks averaged over: their mean is the global loss's gradient.
        aux = self.balance_coeff * self.num_experts * (share * mean_probability).sum() * self.replicas
        if not again:
            self.aux = aux

    def after_optimizer_step(self) -> None:
        """balance=bias: move the selection bias against the load of the step (summed over the data-parallel ranks),
        then start counting afresh; nothing otherwise."""
        if self.balance != "bias":
            return
        load = self.step_load.to(self.router.selection_bias.device)
        if self.sum_over_replicas is not None:
            self.sum_over_replicas(load)
        with torch.no_grad():
            self.router.selection_bias += self.bias_rate * torch.sign(load.mean() - load).to(
                self.router.selection_bias.dtype)
        self.step_load.zero_()

    def pop_aux(self) -> torch.Tensor | None:
        aux, self.aux = self.aux, None
        return aux


class MoETransformer(Transformer):
    """The lab's Transformer with a `MoE` in place of every block's SwiGLU."""

    def __init__(self, vocab_size: int, context_length: int, d_model: int, num_layers: int, num_heads: int,
                 experts: int, top_k: int, expert_d_ff: int, shared_experts: int = 0, router: str = "softmax",
                 balance: str = "aux_loss", balance_coeff: float = 0.01, capacity_factor: float | None = None,
                 bias_rate: float = 1e-3, rope_theta: float = 10000.0, d_ff: int | None = None):
        """`d_ff` is unused (each expert's width is `expert_d_ff`): the config node keeps the dense model's key."""
        super().__init__(vocab_size, context_length, d_model, expert_d_ff, num_layers, num_heads, rope_theta)
        for block in self.blocks:
            block.ffn = MoE(d_model, experts, top_k, expert_d_ff, shared_experts, router, balance, balance_coeff,
                            capacity_factor, bias_rate)
            if block.ffn.shared is not None:
                block.ffn.shared.apply(self._init_weights)
            self._init_weights(block.ffn.router.gate)

    def moe_layers(self) -> list[MoE]:
        return [block.ffn for block in self.blocks]

    def tp_plan(self) -> dict:
        """Tensor parallelism splits attention as the dense model's plan does; the experts stay whole (as torchtitan
        runs them: no expert tensor parallelism). Not offered: the launcher refuses parallel.tp with experts."""
        return {}


def moe_layers(module: nn.Module) -> list[MoE]:
    """Every MoE layer of `module` (a stage of it, a wrapped one), in order."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def after_optimizer_step(layers: list[MoE]):
    """An optimizer step post-hook moving the selection bias of every layer of `layers` (balance=bias): register it
    with `optimizer.register_step_post_hook` (the job's optimizer, or a one-process reference's)."""

    def hook(optimizer, args, kwargs) -> None:
        for layer in layers:
            layer.after_optimizer_step()
    return hook


def expert_bytes(layers: list[MoE]) -> int:
    """Bytes of the experts' parameters these layers hold (a rank's share under expert parallelism)."""
    return sum(p.numel() * p.element_size() for layer in layers for p in layer.experts.parameters())


def load_figures(layers: list[MoE]) -> dict:
    """The last forward's load of every MoE layer (this rank's tokens): the busiest expert's share of the routed
    slots and its load over the mean (both the worst layer's), the share of slots dropped by capacity."""
    if not layers or not layers[0].figures:
        return {}
    loads = [layer.figures["load"].double() for layer in layers]
    slots = sum(layer.figures["slots"] for layer in layers)
    out = {MOE_BUSIEST.key: max(float(load.max() / load.sum()) for load in loads),
           MOE_MAX_OVER_MEAN.key: max(float(load.max() / load.mean()) for load in loads)}
    if layers[0].capacity_factor is not None:
        out[MOE_DROPPED.key] = 100.0 * sum(layer.figures["dropped"] for layer in layers) / max(slots, 1)
    return out


class BalancedLoss:
    """The loss a job trains a mixture with balance=aux_loss on: `inner`'s, plus a term whose value is zero and whose
    gradient is every layer's balancing loss of the forward just run (so the logged loss stays the cross-entropy and
    the gradient is the objective's; the balancing loss goes to the figures). Through the loss, not a hook on the
    layer, so it is divided by the micro-batches and scaled by fp16's loss scale as the cross-entropy is."""

    def __init__(self, inner, layers: list[MoE]):
        self.inner, self.layers, self.last = inner, layers, None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.inner(logits, targets)
        terms = [aux for layer in self.layers if (aux := layer.pop_aux()) is not None]
        if not terms:
            return loss
        aux = torch.stack([t.to(loss.dtype) for t in terms]).sum()
        self.last = float(aux.detach()) / max(layer.replicas for layer in self.layers)
        return loss + (aux - aux.detach())

    def context(self):
        return self.inner.context()

    def pop(self) -> dict:
        """The balancing loss of the last training forward (the global batch's, once averaged over the ranks)."""
        last, self.last = self.last, None
        return {} if last is None else {MOE_AUX.key: last}


def one_process(model: nn.Module, optimizer, capacity_groups: int = 1):
    """Make `model` train on one process as a layout with `capacity_groups` data-parallel ranks does: capacity applied
    per rank-sized group of tokens, the selection bias moved after each of `optimizer`'s steps; returns the loss to
    train on (`BalancedLoss` where a layer balances by aux loss, else the plain cross-entropy). A dense model: the
    cross-entropy, nothing changed."""
    from ddp_lab.tensor_parallel.loss import CrossEntropy

    layers = moe_layers(model)
    for layer in layers:
        layer.capacity_groups = capacity_groups
    if any(layer.balance == "bias" for layer in layers):
        optimizer.register_step_post_hook(after_optimizer_step(layers))
    if any(layer.balance == "aux_loss" for layer in layers):
        return BalancedLoss(CrossEntropy(), layers)
    return CrossEntropy()
