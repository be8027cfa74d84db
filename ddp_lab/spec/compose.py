"""What composes with what: each feature a job can turn on (activation checkpointing, compile, the gradient-error
probe, precision on the wire, checkpoints across meshes) on each axis (tensor parallelism by either impl and with
sequence parallelism, each pipeline schedule, each context-parallel impl, expert parallelism), and in each cell one
of three things:

- proven: the test that trains it against the same job without the feature, or against one process (`PROOFS`);
- refused: the launcher's own line, from the same functions it calls (spec/parallel.py);
- open: it runs, and no test proves it yet (`OPEN`, said in the table as such, never silently).

`python -m ddp_lab.spec --compose` prints the table docs/compose.md keeps; tests/unit/test_compose.py holds every cell
to exactly one of the three, every proof to a test that exists, and every refusal to the launcher's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddp_lab.spec.parallel import checkpointing_problem, compile_problem, grad_error_problem


@dataclass(frozen=True)
class Axis:
    """One column: a mesh beside plain data parallelism, in the `parallel` node's terms."""

    name: str
    keys: str
    """The `parallel.*` overrides that make it (with world_size), as a user types them."""
    tp: int = 1
    tp_impl: str = "lab"
    pp: int = 1
    schedule: str = "1f1b"
    cp: int = 1
    cp_impl: str = "ring"
    ep: int = 1

    @property
    def overrides(self) -> list[str]:
        """`keys` as command-line overrides (the model a column needs is said in brackets)."""
        return self.keys.replace("(", "").replace(")", "").split()


AXES = (
    Axis("tp", "parallel.tp=2", tp=2),
    Axis("tp torch", "parallel.tp=2 parallel.tp_impl=torch", tp=2, tp_impl="torch"),
    Axis("sp", "parallel.tp=2 parallel.sequence_parallel=true", tp=2),
    Axis("gpipe", "parallel.pp=2 parallel.pp_schedule=gpipe", pp=2, schedule="gpipe"),
    Axis("1f1b", "parallel.pp=2", pp=2),
    Axis("interleaved", "parallel.pp=2 parallel.pp_schedule=interleaved_1f1b parallel.stages_per_rank=2", pp=2,
         schedule="interleaved_1f1b"),
    Axis("zero bubble", "parallel.pp=2 parallel.pp_schedule=zero_bubble", pp=2, schedule="zero_bubble"),
    Axis("ring", "parallel.cp=2", cp=2),
    Axis("zigzag", "parallel.cp=2 parallel.cp_impl=zigzag", cp=2, cp_impl="zigzag"),
    Axis("ulysses", "parallel.cp=2 parallel.cp_impl=ulysses", cp=2, cp_impl="ulysses"),
    Axis("hybrid", "parallel.cp=4 parallel.cp_impl=hybrid", cp=4, cp_impl="hybrid"),
    Axis("cp torch", "parallel.cp=2 parallel.cp_impl=torch", cp=2, cp_impl="torch"),
    Axis("ep", "parallel.ep=2 (model=tiny_moe)", ep=2),
)

FEATURES = {
    "checkpointing full": ("train.activation_checkpointing=full",
                           lambda a: checkpointing_problem("full", a.pp, a.schedule)),
    "checkpointing selective": ("train.activation_checkpointing=selective",
                                lambda a: checkpointing_problem("selective", a.pp, a.schedule)),
    "compile": ("train.compile=true", lambda a: compile_problem(a.tp, a.tp_impl, a.cp, a.cp_impl)),
    "grad-error probe": ("measure.grad_error=true", lambda a: grad_error_problem(a.pp, a.schedule)),
    "precision on the wire": ("strategy.comm_dtype=bf16", lambda a: None),
    "checkpoints across meshes": ("checkpoint.every=N, resumed on another mesh", lambda a: None),
}
"""Each row: the keys that turn it on, and the launcher's refusal on an axis (None where it runs)."""

_CKPT = ("tests/parity/test_activation_checkpointing_mesh.py::"
         "test_checkpointing_on_a_mesh_trains_the_same_weights_bit_for_bit")
_CP_MESH = "tests/parity/test_context_parallel.py::test_cp_on_a_mesh_trains_like_one_process"
_COMPILE = "tests/parity/test_compile_mesh.py::test_compiled_on_a_mesh_trains_like_one_process"
_PROBE = "tests/parity/test_grad_error_mesh.py::test_an_exact_strategy_measures_zero_on_every_layout"
_WIRE = ("tests/parity/test_comm_dtype_mesh.py::"
         "test_bf16_on_the_wire_delivers_the_average_to_its_rounding_on_every_mesh")
_MOVES = "tests/parity/test_checkpoint.py::test_a_run_moves_between_meshes"
_CHAIN = "tests/parity/test_checkpoint.py::test_a_run_moves_along_every_schedule_and_context_parallel_impl"


def _checkpointing(mode: str) -> dict:
    cases = {"tp": "tp lab", "tp torch": "tp torch", "sp": "tp lab sp", "gpipe": "pp gpipe lab", "1f1b": "pp 1f1b lab",
             "interleaved": "pp interleaved lab", "zero bubble": "pp zero_bubble lab", "ring": "cp ring",
             "zigzag": "cp zigzag", "ulysses": "cp ulysses", "cp torch": "cp torch", "ep": "ep lab"}
    out = {(f"checkpointing {mode}", axis): f"{_CKPT}[{case}-{mode}]" for axis, case in cases.items()}
    out[(f"checkpointing {mode}", "hybrid")] = f"{_CP_MESH}[hybrid 2x2 {mode} checkpointing]"
    return out


PROOFS: dict[tuple[str, str], str] = {
    **_checkpointing("full"),
    **{key: proof for key, proof in _checkpointing("selective").items() if key[1] != "zero bubble"},
    ("compile", "tp"): f"{_COMPILE}[tp lab]",
    ("compile", "sp"): f"{_COMPILE}[tp lab sp]",
    ("compile", "gpipe"): f"{_COMPILE}[pp gpipe]",
    ("compile", "1f1b"): f"{_COMPILE}[pp lab]",
    ("compile", "interleaved"): f"{_COMPILE}[pp interleaved]",
    ("compile", "zero bubble"): f"{_COMPILE}[pp zero_bubble]",
    ("compile", "ring"): f"{_COMPILE}[cp ring]",
    ("compile", "zigzag"): f"{_COMPILE}[cp zigzag]",
    ("compile", "ulysses"): f"{_COMPILE}[cp ulysses]",
    ("compile", "hybrid"): f"{_CP_MESH}[hybrid 2x2 compiled]",
    ("compile", "ep"): f"{_COMPILE}[ep]",
    ("grad-error probe", "tp"): f"{_PROBE}[tp 2]",
    ("grad-error probe", "tp torch"): f"{_PROBE}[tp 2 torch sequence parallel]",
    ("grad-error probe", "sp"): f"{_PROBE}[tp 2 torch sequence parallel]",
    ("grad-error probe", "gpipe"): f"{_PROBE}[pp 2 gpipe]",
    ("grad-error probe", "1f1b"): f"{_PROBE}[pp 2]",
    ("grad-error probe", "interleaved"): f"{_PROBE}[pp 2 interleaved]",
    ("grad-error probe", "ring"): f"{_PROBE}[cp 2 ring]",
    ("grad-error probe", "zigzag"): f"{_PROBE}[cp 2]",
    ("grad-error probe", "ulysses"): f"{_PROBE}[cp 2 ulysses]",
    ("grad-error probe", "hybrid"): f"{_PROBE}[cp 4 hybrid]",
    ("grad-error probe", "cp torch"): f"{_PROBE}[cp 2 torch]",
    ("grad-error probe", "ep"): f"{_PROBE}[ep 2]",
    **{("precision on the wire", axis.name): f"{_WIRE}[{axis.name}]" for axis in AXES},
    ("checkpoints across meshes", "tp"): f"{_MOVES}[zero2-2x2-lab-bucketed-4x1-lab]",
    ("checkpoints across meshes", "tp torch"): f"{_MOVES}[bucketed-2x1-lab-fsdp_torch-2x2-torch]",
    ("checkpoints across meshes", "sp"): f"{_MOVES}[zero2-2x2-lab-bucketed-4x1-lab]",
    ("checkpoints across meshes", "1f1b"): f"{_MOVES}[zero2-2x2x1-lab-bucketed-4x1-lab]",
    ("checkpoints across meshes", "interleaved"):
        "tests/parity/test_checkpoint.py::test_a_run_moves_off_an_interleaved_pipeline",
    **{("checkpoints across meshes", axis): _CHAIN for axis in ("gpipe", "zero bubble", "ring", "ulysses", "hybrid",
                                                               "cp torch")},
    ("checkpoints across meshes", "zigzag"):
        "tests/parity/test_checkpoint.py::test_a_run_moves_between_context_parallel_meshes[zero2-2xcp2-flat-1xcp1]",
    ("checkpoints across meshes", "ep"): "tests/parity/test_checkpoint.py::"
                                         "test_a_mixture_moves_between_expert_parallel_sizes[bucketed-4ranks-ep2-flat-4ranks-ep4]",
}
"""(row, axis) -> the test (file::function[case]) that proves it."""

OPEN: dict[tuple[str, str], str] = {}
"""(row, axis) -> what is not proven yet, where it runs unrefused: the work left, in the table for users to see."""

_STRATEGIES = "tests/parity/test_strategy_mesh.py::test_every_strategy_trains_like_one_process_on_every_axis"
_AGREEING = "tests/parity/test_strategy_mesh.py::test_demo_keeps_its_replicas_equal_on_every_axis"
_TP2 = "tests/parity/test_tensor_parallel.py::test_tp2_matches_single_process"
_PP2 = "tests/parity/test_pipeline.py::test_pp2_matches_single_process"
_FLOOR = {"tp": f"{_TP2}[transformer lab]", "tp torch": f"{_TP2}[transformer torch]",
          "sp": f"{_TP2}[transformer lab sp]", "gpipe": f"{_PP2}[gpipe m4 lab]", "1f1b": f"{_PP2}[1f1b m4 lab]",
          "interleaved": f"{_PP2}[interleaved v2 m4 lab]", "zero bubble": f"{_PP2}[zero_bubble m4 lab]"}
"""`none` synchronizes nothing: it matches one process where the mesh leaves one replica (tp 2 or pp 2 on 2 ranks)."""

STRATEGY_OPEN: dict[tuple[str, str], str] = {}


def strategy_refusal(strategy: str, axis: Axis) -> str | None:
    """The launcher's refusal of `strategy` on the data-parallel axis of `axis`'s mesh (its spec's `check_mesh` and
    `check_experts`, as launcher/config_checks.py calls them), or None."""
    from ddp_lab.spec.strategies import SPECS

    spec = SPECS[strategy]()
    try:
        spec.check_mesh(axis.tp, axis.pp, axis.schedule, axis.cp)
        spec.check_experts(axis.ep)
    except ValueError as exc:
        return str(exc)
    return None


def strategy_cases() -> list[tuple[str, Axis]]:
    """(strategy, axis) of every cell tests/parity/test_strategy_mesh.py trains: each strategy on each axis it runs
    on, but `none` (its floor proofs, `_FLOOR`)."""
    from ddp_lab.spec.strategies import SPECS

    return [(name, axis) for name in SPECS for axis in AXES
            if name != "none" and strategy_refusal(name, axis) is None]


def strategy_cell(strategy: str, axis: Axis) -> tuple[str, str]:
    """As `cell`, for a strategy on the data-parallel axis of a mesh."""
    refusal = strategy_refusal(strategy, axis)
    if refusal is not None:
        return "refused", refusal
    if strategy == "none":
        if axis.name in _FLOOR:
            return "proven", _FLOOR[axis.name]
        return "open", STRATEGY_OPEN.get((strategy, axis.name), "runs; no test proves it")
    test = _AGREEING if strategy == "demo" else _STRATEGIES
    return "proven", f"{test}[{strategy}-{axis.name}]"


def cell(row: str, axis: Axis) -> tuple[str, str]:
    """("proven", test), ("refused", the launcher's line) or ("open", what is missing)."""
    refusal = FEATURES[row][1](axis)
    if refusal is not None:
        return "refused", refusal
    if (row, axis.name) in PROOFS:
        return "proven", PROOFS[(row, axis.name)]
    return "open", OPEN.get((row, axis.name), "runs; no test proves it")


def compose_markdown() -> str:
    """The table, proofs and refusals numbered below it (a cell holds a mark and its note's number)."""
    marks = {"proven": "✓", "refused": "✗", "open": "?"}
    notes: list[str] = []

    def note(text: str) -> int:
        if text not in notes:
            notes.append(text)
        return notes.index(text) + 1

    head = "| feature | " + " | ".join(a.name for a in AXES) + " |"
    lines = [head, "|---" * (len(AXES) + 1) + "|"]
    for row, (keys, _) in FEATURES.items():
        cells = []
        for axis in AXES:
            kind, text = cell(row, axis)
            cells.append(f"{marks[kind]} [{note(text if kind != 'proven' else '`' + text + '`')}]")
        lines.append(f"| {row} (`{keys}`) | " + " | ".join(cells) + " |")
    from ddp_lab.spec.strategies import SPECS

    lines += ["", "| strategy (`strategy=`) | " + " | ".join(a.name for a in AXES) + " |",
              "|---" * (len(AXES) + 1) + "|"]
    for name in SPECS:
        cells = []
        for axis in AXES:
            kind, text = strategy_cell(name, axis)
            if kind == "proven" and text.startswith((_STRATEGIES, _AGREEING)):
                cells.append("✓")  # named by the rule under the table
            elif kind == "refused":  # the line without the column's keys, which open it
                cells.append(f"✗ [{note(text.split(': ', 1)[1] if text.startswith('parallel.') else text)}]")
            else:
                cells.append(f"{marks[kind]} [{note(text if kind != 'proven' else '`' + text + '`')}]")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"A strategy's ✓ without a number: `{_STRATEGIES}[<strategy>-<column>]` (demo's, which changes the "
              f"average on purpose: `{_AGREEING}[demo-<column>]`)."]
    lines += ["", "✓ proven by the test named, ✗ refused by launch.py with the line quoted, ? runs but not proven yet.",
              "", "The columns: " + "; ".join(f"{a.name}: `{a.keys}`" for a in AXES) + ".", ""]
    lines += [f"{i}. {text}" for i, text in enumerate(notes, 1)]
    return "\n".join(lines)
