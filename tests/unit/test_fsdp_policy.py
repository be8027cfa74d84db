"""fsdp's policy on known models: which submodules are units, which parameters are sharded, where a
tied weight goes, and the refusal of a model with nothing to shard (no process group needed)."""

import pytest
import torch

from ddp_lab.check.models import NormNet, NothingToShard, OwnClassesNet, TiedNet, tiny_transformer
from ddp_lab.spec.strategies.fsdp import FSDPSpec
from ddp_lab.strategies.fsdp import FSDP, plan_units
from ddp_lab.strategies.fsdp.wrapper import resolve_compute_dtype


def _summary(model, policy="linear_embedding"):
    return [(u.name, sorted(p.name for p in u.params if p.sharded), sorted(p.name for p in u.params if not p.sharded))
            for u in plan_units(model, policy)]


def test_transformer_units_are_embedding_blocks_head_and_a_root_for_the_final_norm():
    units = _summary(tiny_transformer())
    assert [name for name, *_ in units] == ["embed", "blocks.0", "blocks.1", "lm_head", ""]
    assert units[1][1] == ["blocks.0.attn.proj.weight", "blocks.0.attn.qkv.weight", "blocks.0.ffn.w1.weight",
                           "blocks.0.ffn.w2.weight", "blocks.0.ffn.w3.weight"]
    assert units[1][2] == ["blocks.0.ln1.weight", "blocks.0.ln2.weight"]  # norms replicated
    assert units[-1] == ("", [], ["ln_final.weight"])


def test_all_params_shards_norms_and_biases_too():
    units = _summary(NormNet(), "all_params")
    assert all(not replicated for _, _, replicated in units)
    assert [name for name, *_ in units] == ["embed", "hidden", "norm", "rms", "out"]
    assert _summary(NormNet())[1] == ("hidden", ["hidden.weight"], ["hidden.bias"])


def test_a_weight_tied_across_units_goes_to_the_root():
    units = _summary(TiedNet())
    assert units == [("hidden", ["hidden.weight"], ["hidden.bias"]), ("", ["embed.weight"], [])]
    root = plan_units(TiedNet())[-1]
    assert sorted(s.qualname for s in root.params[0].slots) == ["embed.weight", "out.weight"]


def test_nothing_to_shard_is_refused_before_any_collective():
    model = NothingToShard(vocab_size=8, context_length=4, d_model=4)
    with pytest.raises(ValueError, match="no parameter the policy shards"):
        FSDPSpec().check_model(model)  # the launcher's question, asked of the strategy's spec
    with pytest.raises(ValueError, match="no parameter the policy shards"):
        FSDP(model)  # raises before the start-up broadcast: no process group needed
    with pytest.raises(ValueError, match="unknown fsdp policy"):
        plan_units(tiny_transformer(), "rows")


def test_compute_dtypes():
    assert resolve_compute_dtype(None) is None and resolve_compute_dtype("fp32") is None
    assert resolve_compute_dtype("bf16") is torch.bfloat16 and resolve_compute_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="compute_dtype"):
        resolve_compute_dtype(torch.int8)


def test_a_users_own_linear_and_embedding_classes_are_sharded_and_their_norms_replicated():
    """CS336 students write Linear, Embedding and RMSNorm as classes of their own: the 2-D weights of
    those leaf layers are sharded as torch's are, the norms' 1-D gains replicated."""
    units = plan_units(OwnClassesNet())
    sharded = {p.name for u in units for p in u.params if p.sharded}
    replicated = {p.name for u in units for p in u.params if not p.sharded}
    assert sharded == {"embed.weight", "blocks.0.linear.weight", "blocks.1.linear.weight", "head.weight"}
    assert replicated == {"blocks.0.norm.gain", "blocks.1.norm.gain", "norm.gain"}
    assert [u.name for u in units] == ["embed", "blocks.0", "blocks.1", "head", ""]


def test_the_refusal_says_what_it_found():
    with pytest.raises(ValueError, match=r"found 1 parameters: norm.weight \(4,\)"):
        plan_units(NothingToShard(vocab_size=8, context_length=4, d_model=4))
