"""The calculator's `--ep` (analysis/expert_accounting.py): the published mixtures' parameters from their
configurations against the figures their authors publish, one counted by hand, and the report's arithmetic."""

from __future__ import annotations

import pytest

from ddp_lab.analysis.calculator import main
from ddp_lab.analysis.expert_accounting import SHAPES, MoEShape, expert_accounting


@pytest.mark.parametrize(("name", "total", "active"), [
    ("deepseek_v3", 671e9, 37e9), ("mixtral_8x7b", 46.7e9, 12.9e9), ("qwen3_235b_a22b", 235e9, 22e9)])
def test_the_published_counts_are_the_published_figures(name, total, active):
    """Each model card's total and active parameters, within 2% (they round to the billion; DeepSeek's 37B is
    37.5 counted with the embedding's lookup)."""
    counts = SHAPES[name].counts()
    assert counts["total"] == pytest.approx(total, rel=0.005)
    assert counts["active"] == pytest.approx(active, rel=0.02)


def test_a_small_shape_counted_by_hand():
    """d 8, 2 layers (the first dense, d_ff 16), 4 experts of width 4, top-1, one shared, 2 heads of 4 with one
    K/V head, vocab 10, untied."""
    shape = MoEShape("hand", "a test", vocab=10, d_model=8, layers=2, dense_layers=1, dense_d_ff=16, experts=4,
                     top_k=1, expert_d_ff=4, shared_experts=1, heads=2, kv_heads=1, head_dim=4)
    attention = 8 * 8 * 2 + 2 * 8 * 4  # q and o: 8 x 8 each; k and v: 8 x 4 each
    expert = 3 * 8 * 4
    dense = 3 * 8 * 16
    common = 2 * attention + expert + 4 * 8 + dense + 2 * 10 * 8  # + shared, router, dense SwiGLU, embedding, head
    assert shape.counts() == {"total": common + 4 * expert, "active": common + expert, "routed_experts": 4 * expert,
                              "lookup": 80}
    report = expert_accounting(shape, [1, 2, 3], tokens=10, dtype="fp32")
    one, two, bad = report["rows"]
    assert one["a2a_bytes"] == 0 and two["a2a_bytes"] == 4 * 10 * 1 * 8 * 4 * 1 / 2  # 4·T·k·d·b·(P−1)/P, 1 layer
    assert two["params_per_rank"] == common + 2 * expert and two["experts_per_rank"] == 2
    assert two["expert_flops"] == 6 * 10 * 1 * expert
    assert "divide the 4 experts" in bad["problem"]


def test_the_ep_report_prints_and_refuses_a_dense_model(capsys):
    assert main(["--model", "mixtral_8x7b", "--ep", "1,8"]) == 0
    out = capsys.readouterr().out
    assert "46.70 B parameters, 12.88 B active per token" in out and "4,096 tokens per rank" in out
    assert main(["--model", "tiny_moe", "--ep", "2", "--tokens", "128"]) == 0
    with pytest.raises(SystemExit):
        main(["--model", "tiny", "--ep", "2"])
    assert "model=tiny has no experts" in capsys.readouterr().err
