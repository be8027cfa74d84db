"""Zero bubble's weight half (W) in the lab's pipeline on a checkpointed stage: every weight's gradient in one
backward (pipeline_parallel/lab.py's `backward_weights_at_once`), equal to a whole backward's, and a checkpointed
block recomputed once in it, where torch's `stage_backward_weight` (one backward per weight) recomputes it 7 times;
its price, the input's path run again: one forward's FLOPs more than a W of the weights alone (the planner prices
it: analysis/plan/price.py's `reruns_input_path`); on a stage without checkpointing W stays torch's."""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ddp_lab.models.transformer import Block, RotaryEmbedding
from ddp_lab.pipeline_parallel.lab import backward_weights_at_once, weights_pass
from ddp_lab.rank.recompute import apply_activation_checkpointing

D, D_FF, HEADS, CONTEXT = 32, 64, 4, 8


def _stage(mode: str) -> nn.Module:
    torch.manual_seed(0)
    stage = nn.Module()
    stage.blocks = nn.ModuleList([Block(D, HEADS, D_FF, RotaryEmbedding(D // HEADS, CONTEXT, 10000.0))
                                  for _ in range(2)])
    apply_activation_checkpointing(stage, mode)
    return stage


def _forward(stage: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for block in stage.blocks:
        x = block(x)
    return x.pow(2).mean()


def _split(stage: nn.Module, weights_pass, ran: list | None = None) -> tuple[dict, int]:
    """I then W as the lab's pipeline runs them: (each weight's gradient, the blocks' forwards W ran, counted into
    `ran` by a counting `Block.forward`)."""
    ran = [] if ran is None else ran
    x = torch.randn(2, CONTEXT, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    params = [p for p in stage.parameters() if p.requires_grad]
    _, groups = stage_backward_input([_forward(stage, x)], None, [x], iter(params))
    before = len(ran)
    weights_pass(params, groups)
    return {n: p.grad for n, p in stage.named_parameters()}, len(ran) - before


@pytest.mark.parametrize("mode", ["none", "full"])
def test_one_backward_gives_every_weight_a_whole_backwards_gradient(mode):
    stage = _stage(mode)
    whole = copy.deepcopy(stage)
    _forward(whole, torch.randn(2, CONTEXT, D, generator=torch.Generator().manual_seed(1),
                                requires_grad=True)).backward()
    grads, _ = _split(stage, backward_weights_at_once)
    for name, p in whole.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=0, msg=name)


def test_a_checkpointed_block_is_recomputed_once_in_w_not_once_a_weight(monkeypatch):
    ran, forward = [], Block.forward  # the recompute calls the block's forward, not the module (no module hooks)
    monkeypatch.setattr(Block, "forward", lambda self, x: ran.append(1) or forward(self, x))
    _, ours = _split(_stage("full"), backward_weights_at_once, ran)
    _, torchs = _split(_stage("full"), lambda params, groups: stage_backward_weight(iter(params), groups), ran)
    assert ours == 2  # each of the 2 blocks once
    assert torchs == 2 * 7  # a block's 7 weights (2 norms, qkv, proj, w1, w2, w3): a backward, and a recompute, each


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_w_is_one_backward_only_where_the_blocks_are_checkpointed(mode):
    assert (weights_pass(_stage(mode)) is backward_weights_at_once) == (mode != "none")


class _Flops(TorchDispatchMode):
    """The FLOPs of the matmuls and attention run under it, by torch's own formulas (torch's FlopCounterMode wraps
    modules in autograd functions, which checkpointing's unpack hooks refuse in `stage_backward_input`)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket in flop_registry:
            self.flops += flop_registry[func._overloadpacket](*args, **(kwargs or {}), out_val=out)
        return out


def test_w_on_a_checkpointed_stage_runs_the_input_path_again():
    """What W costs on a fully checkpointed stage, in forwards' FLOPs: I runs the recompute (0.8: it stops once
    backward's tensors are back) and the input's gradients (1); W the recompute again, the weights' gradients (1) and
    the input's path between them again (1): 2.8, a whole backward's, where a W without it would run 1.8."""
    stage = _stage("full")
    x = torch.randn(2, CONTEXT, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    params = list(stage.parameters())
    with _Flops() as forward:
        loss = _forward(stage, x)
    with _Flops() as input_half:
        _, groups = stage_backward_input([loss], None, [x], iter(params))
    with _Flops() as weight_half:
        backward_weights_at_once(params, groups)
    assert forward.flops > 0
    assert (round(input_half.flops / forward.flops, 1), round(weight_half.flops / forward.flops, 1)) == (1.8, 2.8)
