"""cores.py: a pipeline's step with its ranks sharing this machine's cores, simulated
(docs/measured/plan_unseen_deep.md)."""

import pytest

from ddp_lab.analysis.plan.cores import shared_span
from ddp_lab.spec.pipeline import simulate


@pytest.mark.parametrize("schedule,pp,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 5, 1),
                                             ("zero_bubble", 4, 8, 1), ("zero_bubble", 2, 2, 1),
                                             ("interleaved_1f1b", 2, 4, 2)])
def test_with_a_core_a_rank_the_step_is_the_schedule_run_on_paper(schedule, pp, m, v):
    """Where every rank has a core, nothing is shared: the span is spec/pipeline.py's `simulate` of the same actions
    at the same uneven costs (each later stage heavier, I and W apart)."""
    costs = tuple((1 + s / 2, 1.25 + s / 2, 1.5 + s / 2) for s in range(pp * v))
    on_paper = simulate(schedule, pp, m, v, stage_costs=[{"F": f, "I": i, "W": w, "B": i + w} for f, i, w in costs])
    assert shared_span(schedule, pp, m, v, costs, 1, pp) == pytest.approx(on_paper.step)


def test_three_stages_on_two_cores_by_hand():
    """GPipe, pp 3, m 3, F 1 and B 2 (I 1, W 1) everywhere: with a core each, (m + p - 1)(F + B) = 15. On 2 cores
    the three stages are runnable at once twice, in the forwards' middle (s0's F2, s1's F1, s2's F0) and the
    backwards' (s2's B2, s1's B1, s0's B0), at 2/3 of a core each: 1.5 where 1, and 3 where 2: 16.5."""
    costs = ((1.0, 1.0, 1.0),) * 3
    assert shared_span("gpipe", 3, 3, 1, costs, 1, 3) == pytest.approx(15.0)
    assert shared_span("gpipe", 3, 3, 1, costs, 1, 2) == pytest.approx(16.5)


def test_a_stage_of_many_ranks_counts_each_of_them():
    """dp 2 x pp 2 on 2 cores, GPipe, m 2, s0's F 1 (B 2) and s1's F 2 (B 4): two ranks a stage, so one stage
    runnable fills the cores and both halve them. s0's F0 (t 1); s0's F1 beside s1's F0 at half a core (t 3, s1 left
    1); s1 alone (F0 t 4, F1 t 6, B0 t 10); s1's B1 beside s0's B0 (t 14, s1 left 2; t 16); s0's B1 (t 18): the
    ranks' work (2 x 6 + 2 x 12) over the cores, with nothing idle."""
    costs = ((1.0, 1.0, 1.0), (2.0, 2.0, 2.0))
    assert shared_span("gpipe", 2, 2, 1, costs, 2, 2) == pytest.approx(18.0)
