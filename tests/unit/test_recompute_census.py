"""What activation checkpointing keeps, counted by the census (rank/activations.py) though torch holds it outside the
saved-tensor hooks the census reads: under `full` a block keeps its input only; under `selective` its input and its
matmuls' outputs (rank/recompute.py's policy). One block of the lab's Transformer, worked by hand."""

import pytest
import torch
from torch import nn

from ddp_lab.models.transformer import Block, RotaryEmbedding
from ddp_lab.rank.activations import SavedActivations
from ddp_lab.rank.recompute import apply_activation_checkpointing

TOKENS, D, D_FF, HEADS = 2 * 8, 32, 64, 4
FP32 = 4


def _census(mode: str) -> int:
    torch.manual_seed(0)
    holder = nn.Module()
    holder.blocks = nn.ModuleList([Block(D, HEADS, D_FF, RotaryEmbedding(D // HEADS, 8, 10000.0))])
    apply_activation_checkpointing(holder, mode)
    x = torch.randn(2, 8, D, requires_grad=True)  # the block's input: an activation, not a parameter
    census = SavedActivations()
    hooks, done = census.counting("forward")
    with hooks:
        out = holder.blocks[0](x)
    done()
    out.sum().backward()
    return census.largest


def test_full_checkpointing_keeps_the_blocks_input_only():
    assert _census("full") == TOKENS * D * FP32


def test_selective_keeps_the_input_and_the_matmuls_outputs():
    """qkv (3d), attention's output projection (d), the MLP's w1 and w3 (d_ff each) and w2 (d), per token."""
    assert _census("selective") == TOKENS * D * FP32 + TOKENS * (3 * D + D + 2 * D_FF + D) * FP32


def test_without_checkpointing_the_block_keeps_more_than_either():
    assert _census("none") > _census("selective") > _census("full")


def test_a_forward_that_raises_leaves_no_tally_behind():
    """A later forward nobody counts must not add to a tally left open by an error."""
    from ddp_lab.rank.activations import _COUNTING

    hooks, _ = SavedActivations().counting("forward")
    with pytest.raises(RuntimeError), hooks:
        raise RuntimeError("a rank's forward failed")
    assert _COUNTING == []


@pytest.mark.parametrize("census", ["saved", "held"])
def test_counting_keeps_no_graph_alive_that_autograd_let_go(census):
    """A tensor saved as its own node's output (rsqrt's) must not be packed as itself: it holds the node that holds
    it, a cycle through C++ no collector sees, and the graph of a forward whose backward kept its graph
    (`retain_graph=True`, as zero bubble's input half runs) stayed alive for good once its tensors were dropped."""
    import gc
    import weakref

    from ddp_lab.rank.activations import HeldActivations

    x = torch.randn(8, requires_grad=True)
    if census == "saved":
        hooks, done = SavedActivations().counting("forward")
    else:
        hooks, done = HeldActivations().counting(), None
    with hooks:
        out = x.exp().rsqrt()  # both save their own output
    if done is not None:
        done()
    out.sum().backward(retain_graph=True)
    alive = weakref.ref(out)
    del out
    gc.collect()
    assert alive() is None
