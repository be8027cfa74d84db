"""DeepSpeed's ZeRO stages 1, 2 and 3 behind the strategy contract train like one process, count what they send,
and are refused before launch where they cannot run.

The parity cases of `python -m ddp_lab.check` (plain AdamW, SGD, a frozen layer, a tied weight, an unused
parameter; each at 25 MB buckets and at buckets smaller than the largest parameter) at 2 and 3 ranks for
each stage, to float32 rounding against single-process training on the full batch, but the unused
parameter: DeepSpeed gives it a zero gradient in its flat partitions, which AdamW's weight decay moves (as
the lab's own bucketed engine does), where one process leaves it alone. Accumulation is not a case:
DeepSpeed's ZeRO 2 and 3 have no no_sync, and train.grad_accum_steps > 1 is refused before launch. The memory
census (test_memory_census.py), the text parity (test_text_data.py) and teardown (test_teardown.py)
include DeepSpeed's stages too, where it is installed.
"""

import pytest
import torch

from ddp_lab.check.cases import case_of, locate, run_cases, runs
from ddp_lab.check.parity import ATOL, RTOL, train_distributed
from ddp_lab.check.ranks import run_ranks
from ddp_lab.check.verdict import verdict
from ddp_lab.jobdir import checkpoint_path
from ddp_lab.spec.strategies import SPECS, SpecError, spec_of
from tests.helpers.extras import requires_deepspeed, skip_without_deepspeed
from tests.helpers.launching import ROOT

STAGES = (1, 2, 3)
CASES = ["plain", "sgd", "frozen", "tied", "unused"]  # each at 25 MB buckets and at half the largest parameter
TARGET = "ddp_lab.strategies.DeepSpeedZeRO"


def _runs(stage: int) -> list[str]:
    return runs(locate(TARGET), {"stage": stage}, CASES)


def _every_stage(rank, world_size):
    out = {stage: run_cases(rank, world_size, TARGET, {"stage": stage}, _runs(stage)) for stage in STAGES}
    # what the counted collectives saw in a step of stage 2: its reduce buckets and the all-gather after the step
    spec = SPECS["deepspeed_zero2"]()
    out["comm"] = train_distributed(rank, world_size, spec.build, "transformer", steps=2,
                                    inspect=lambda wrapper, optimizer: wrapper.comm.pop())[2]
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def results(request):
    skip_without_deepspeed()
    return run_ranks(_every_stage, request.param)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("case", CASES)
def test_every_stage_trains_like_one_process(results, stage, case):
    for run in [r for r in _runs(stage) if case_of(r)[0].name == case]:
        found = verdict(case_of(run)[0], [r[stage][run] for r in results], ATOL, RTOL)
        if case == "unused":  # a zero gradient, stepped: the one way it differs from one process
            assert found is not None and found.startswith("the unused parameter moved"), (run, found)
        else:
            assert found is None, (run, found)


def test_its_collectives_are_counted(results):
    for rank_result in results:
        comm = rank_result["comm"]
        assert comm["collectives"] > 0 and comm["comm_bytes"] > 0 and comm["comm_ms"] > 0


def _engine_and_optimizer(rank, world_size):
    spec = SPECS["deepspeed_zero1"](bucket_mb=1.0)
    model = spec.build(torch.nn.Linear(8, 8))
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
    config = model.ds_config()
    return (type(model.engine).__name__, type(optimizer.optim).__name__, model.facts()["deepspeed"]["stage"],
            config["zero_optimization"]["reduce_bucket_size"])


@requires_deepspeed
def test_the_runtime_is_the_engine_and_its_optimizer_the_inner_adamw():
    """make_optimizer builds DeepSpeed's engine; the optimizer the trainer steps exposes the AdamW
    over this rank's fp32 partition as `.optim` (what the memory accounting reads)."""
    for engine, inner, stage, bucket in run_ranks(_engine_and_optimizer, 2):
        assert (engine, inner, stage) == ("DeepSpeedEngine", "AdamW", 1) and bucket == 2**20 // 4


def test_without_deepspeed_a_run_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    import importlib.util

    from ddp_lab.config import register_configs
    from ddp_lab.launcher.preflight import EXIT_BAD_INPUT, check_command_line

    register_configs()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(SystemExit) as exit_:
        check_command_line(ROOT / "conf", "config", ["strategy=deepspeed_zero2", f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_.value.code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "needs DeepSpeed, which is not installed" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("setting, phrase", [("precision", "train.precision=fp32 only"),
                                             ("grad_accum_steps", "train.grad_accum_steps=1 only")])
def test_what_deepspeed_cannot_take_is_refused_in_one_line(setting, phrase, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec  # these refusals hold with or without DeepSpeed installed
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "deepspeed" else real(name, *a))
    spec = SPECS["deepspeed_zero2"]()
    with pytest.raises(ValueError, match=phrase):
        spec.check_run("bf16" if setting == "precision" else "fp32", 2 if setting == "grad_accum_steps" else 1)
    spec.check_run("fp32", 1)


@requires_deepspeed
def test_every_stage_continues_bit_for_bit_from_its_own_checkpoint(tmp_path):
    """DeepSpeed's own format (its engine's save_checkpoint, completed and renamed as every checkpoint is): a
    step, a checkpoint, a step more, against a model of other weights loaded from it."""
    from tests.parity.test_checkpoint import OWN_FORMAT, _check_continued, _continue

    assert OWN_FORMAT == [f"deepspeed_zero{s}" for s in STAGES]
    _check_continued(run_ranks(_continue, 2, OWN_FORMAT, ["transformer"], tmp_path), exact=True)


def _into_another(rank, world_size, root):
    """deepspeed_zero2's checkpoint, then a load of it by bucketed: refused, naming the format."""
    from ddp_lab.rank.checkpoint import CheckpointError, load, save
    from tests.parity.test_checkpoint import _build, _steps

    model, optimizer, precision = _build({"name": "deepspeed_zero2"}, "transformer", rank)
    _steps(model, optimizer, precision, rank, world_size, range(1))
    saving = save(root, 1, model, optimizer, precision, {"strategy": "deepspeed_zero2", "world_size": world_size})
    written = saving.wait()
    model, optimizer, precision = _build({"name": "bucketed"}, "transformer", rank)
    with pytest.raises(CheckpointError) as error:
        load(checkpoint_path(root, 1), model, optimizer, precision, {"strategy": "bucketed"})
    return written, str(error.value)


@requires_deepspeed
def test_its_checkpoint_loads_nowhere_else(tmp_path):
    for written, error in run_ranks(_into_another, 2, tmp_path):
        assert written > 0
        assert "it is in deepspeed's own format, written by strategy=deepspeed_zero2 at 2 ranks" in error


def test_its_stage_is_the_option_not_a_knob():
    assert [SPECS[f"deepspeed_zero{s}"].zero_stage for s in STAGES] == [1, 2, 3]
    with pytest.raises(SpecError, match="not a knob"):
        spec_of({"name": "deepspeed_zero2", "stage": 3})
