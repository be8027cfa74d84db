"""Each column of docs/compose.md (ddp_lab/spec/compose.py's AXES) as a job of `train_on_mesh` on 4 ranks: the model
and the mesh's keys. The data-parallel axis keeps 2 ranks beside tp 2, pp 2 or cp 2 (4 beside ep 2, and hybrid's cp 4
is the strategy's whole group), so that every strategy has replicas to synchronize."""

from __future__ import annotations

from tests.helpers.moe import tiny_moe

PIPE = {"pp": 2, "microbatches": 2}
AXIS_JOBS = {
    "tp": ("transformer", dict(tp=2)),
    "tp torch": ("transformer", dict(tp=2, impl="torch")),
    "sp": ("transformer", dict(tp=2, sequence_parallel=True)),
    "gpipe": ("transformer", dict(pipeline={**PIPE, "pp_schedule": "gpipe"})),
    "1f1b": ("transformer", dict(pipeline=PIPE)),
    "interleaved": ("deep_transformer", dict(pipeline={**PIPE, "stages_per_rank": 2,
                                                       "pp_schedule": "interleaved_1f1b"})),
    "zero bubble": ("transformer", dict(pipeline={**PIPE, "pp_schedule": "zero_bubble"})),
    "ring": ("transformer", dict(context={"cp": 2, "cp_impl": "ring"})),
    "zigzag": ("transformer", dict(context={"cp": 2, "cp_impl": "zigzag"})),
    "ulysses": ("transformer", dict(context={"cp": 2, "cp_impl": "ulysses"})),
    "hybrid": ("transformer", dict(context={"cp": 4, "cp_impl": "hybrid", "cp_ulysses": 2})),
    "cp torch": ("transformer", dict(context={"cp": 2, "cp_impl": "torch"})),
    "ep": (tiny_moe(), dict(experts={"ep": 2})),
}
"""Column name -> (model: a check/models.py name or a factory, train_on_mesh's mesh keywords)."""
