"""Checkpoints (rank/checkpoint.py) continue a run exactly and move it between strategies and world sizes.

- continue exactly: a step, a checkpoint, a step more, against a second model (other random weights)
  loaded from the checkpoint and run the same step: bit for bit at 2 ranks, to float32 rounding at 3 (a
  fresh torch DDP sums in other buckets on its first step, and at 3 ranks the order of a sum is not
  free), for every strategy that can be checkpointed, on a model with tied and one with frozen
  parameters and on the tiny Transformer;
- move: a step under A at N ranks, a checkpoint, a step under B at M ranks, against 2 steps under B at M
  ranks from the same first weights and batches; parameters and optimizer state, read back whole from
  each run's final checkpoint (DCP's own `dcp_to_torch_save`), equal to float32 rounding.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ddp_lab.check.models import MODELS
from ddp_lab.check.parity import ATOL, RTOL, data_cfg, full_state
from ddp_lab.check.ranks import run_ranks
from ddp_lab.jobdir import checkpoint_path
from ddp_lab.spec.strategies import SPECS


def _takes_checkpoints(spec_cls) -> bool:
    """Its spec lets checkpoint.every be set with its default knobs (torchft's DiLoCo refuses: its own state)."""
    try:
        spec_cls().check_checkpoints()
    except ValueError:
        return False
    return True


CHECKPOINTED = [name for name, spec in SPECS.items() if spec.own_checkpoint is None and _takes_checkpoints(spec)]
OWN_FORMAT = [name for name, spec in SPECS.items() if spec.own_checkpoint is not None]  # test_deepspeed.py
SHARDED = ["zero1", "zero2", "fsdp", "fsdp_torch", "zero1_torch", "hsdp"]
PRECISION = "fp32"
BATCH = 12  # the same global batches at 2, 3 and 4 ranks
HALF = 1    # steps before the checkpoint, and after it: AdamW state exists after one


def _build(strategy: dict, model: str, seed: int, precision: str = PRECISION):
    from ddp_lab.spec.strategies import spec_of
    from ddp_lab.tasks.train import wrap

    torch.manual_seed(seed)
    return wrap(spec_of(strategy), MODELS[model](), precision, "cpu", 1e-2, 0.1)


def _steps(model, optimizer, precision, rank, world_size, steps):
    from ddp_lab.rank.data import BatchSource
    from ddp_lab.rank.step import train_step

    batches = BatchSource(data_cfg(1, BATCH), rank, world_size, torch.device("cpu"))
    for step in steps:
        train_step(model, optimizer, list(batches.micro_batches(step)), precision=precision)


def _continue(rank, world_size, strategies, models, root, compute=PRECISION, asynchronous=False, half=HALF):
    """{(strategy, model): (weights after 2 x half steps straight, after half + a reload + half)}, on every
    rank. In fp16 the loss scaler is set where no run would be by then, and must come back as it was.
    `asynchronous`: the checkpoint is written by DCP's async_save while the next steps change the weights it
    was taken of. A strategy is its name or its config."""
    import torch.distributed as dist

    from ddp_lab.rank.checkpoint import load, save

    background = dist.new_group(backend="gloo") if asynchronous else None
    out = {}
    for strategy in strategies:
        strategy = strategy if isinstance(strategy, dict) else {"name": strategy}
        name = "-".join(f"{v}" for v in strategy.values())
        for model_name in models:
            folder = root / f"{name}-{model_name}"
            model, optimizer, precision = _build(strategy, model_name, rank, compute)
            _steps(model, optimizer, precision, rank, world_size, range(half))
            if precision.scaler is not None:
                precision.scaler.scale, precision.scaler.clean_steps = 1024.0, 7
            saving = save(folder, half, model, optimizer, precision,
                          {"strategy": strategy["name"], "world_size": world_size}, background)
            _steps(model, optimizer, precision, rank, world_size, range(half, 2 * half))
            saving.wait()
            straight = full_state(model)
            model, optimizer, precision = _build(strategy, model_name, 100 + rank, compute)  # other weights
            assert load(checkpoint_path(folder, half), model, optimizer, precision).step == half
            if precision.scaler is not None:
                assert (precision.scaler.scale, precision.scaler.clean_steps) == (1024.0, 7)
            _steps(model, optimizer, precision, rank, world_size, range(half, 2 * half))
            out[name, model_name] = (straight, full_state(model))
    return out


def _check_continued(results, exact: bool) -> None:
    for rank, result in enumerate(results):
        for key, (straight, resumed) in result.items():
            for tensor_name, tensor in straight.items():
                if exact:
                    assert torch.equal(resumed[tensor_name], tensor), f"rank {rank} {key} {tensor_name}: not exact"
                else:
                    torch.testing.assert_close(resumed[tensor_name], tensor, atol=ATOL, rtol=RTOL,
                                               msg=lambda m, k=key, n=tensor_name, r=rank: f"rank {r} {k} {n}: {m}")


def test_every_strategy_continues_bit_for_bit_at_2_ranks(tmp_path):
    _check_continued(run_ranks(_continue, 2, CHECKPOINTED, ["tied", "frozen", "transformer"], tmp_path), exact=True)


OWN_STATE = [{"name": "powersgd", "start_iter": 0, "rank": 2},            # error feedback and Q from step 1
             {"name": "powersgd", "start_iter": 2},                       # plain, then compressing
             {"name": "local_sgd", "sync_every": 2, "outer": "nesterov"},  # ranks apart at the save; momentum
             {"name": "local_sgd", "sync_every": 4},
             {"name": "local_sgd", "sync_every": 2, "outer_topk": 4, "outer_chunk": 8},  # SparseLoCo's error feedback
             {"name": "local_sgd", "sync_every": 4, "fragments": 2, "outer": "nesterov"}]  # streaming: one mid-round


def test_a_strategys_own_state_continues_bit_for_bit(tmp_path):
    """powersgd's per-rank error feedback and warm-start Q; local SGD's ranks, apart between syncs, and
    DiLoCo's outer state (streaming's per fragment, SparseLoCo's error feedback): 3 steps, a checkpoint, 3 more,
    on every rank."""
    _check_continued(run_ranks(_continue, 2, OWN_STATE, ["transformer"], tmp_path, PRECISION, False, 3), exact=True)


def _local_then_average(rank, world_size, root):
    """local_sgd, 1 step (ranks apart), a checkpoint; the ranks' average of the weights it was taken of."""
    import torch.distributed as dist

    from ddp_lab.rank.checkpoint import save

    model, optimizer, precision = _build({"name": "local_sgd", "sync_every": 4}, "transformer", seed=rank)
    _steps(model, optimizer, precision, rank, world_size, range(1))
    save(root, 1, model, optimizer, precision, {"strategy": "local_sgd", "world_size": world_size})
    state = full_state(model)
    for tensor in state.values():
        dist.all_reduce(tensor)
        tensor.div_(world_size)
    return state


def _loaded(rank, world_size, strategy, path):
    from ddp_lab.rank.checkpoint import load

    model, optimizer, precision = _build(strategy, "transformer", seed=100 + rank)
    return load(path, model, optimizer, precision).rank_state, full_state(model)


def test_another_strategy_or_world_size_starts_from_the_ranks_average(tmp_path):
    """A local_sgd checkpoint taken while ranks are apart loads elsewhere as their average; at another world
    size a strategy's own per-rank state starts afresh, and at the same it comes back."""
    average = run_ranks(_local_then_average, 2, tmp_path)[0]
    path = checkpoint_path(tmp_path, 1)
    for world_size, strategy, own in [(3, {"name": "bucketed"}, False), (3, {"name": "local_sgd"}, False),
                                      (2, {"name": "local_sgd"}, True)]:
        for rank_state, state in run_ranks(_loaded, world_size, strategy, path):
            assert rank_state is own
            if not own:
                for name, tensor in average.items():
                    torch.testing.assert_close(state[name], tensor, atol=ATOL, rtol=RTOL)


def test_fp16_continues_with_its_loss_scale(tmp_path):
    _check_continued(run_ranks(_continue, 2, ["bucketed", "zero2"], ["transformer"], tmp_path, "fp16"), exact=True)


def test_an_async_save_writes_the_state_it_was_taken_of(tmp_path):
    """checkpoint.async_save: the next step changes parameters and optimizer state while DCP writes."""
    _check_continued(run_ranks(_continue, 2, ["bucketed", "zero2", "fsdp", "fsdp_torch"], ["transformer"], tmp_path,
                               PRECISION, True), exact=True)


def test_sharded_strategies_continue_at_3_ranks(tmp_path):
    _check_continued(run_ranks(_continue, 3, SHARDED, ["transformer"], tmp_path), exact=False)


def _first(rank, world_size, strategy, root):
    from ddp_lab.rank.checkpoint import save

    model, optimizer, precision = _build(strategy, "transformer", seed=rank)
    _steps(model, optimizer, precision, rank, world_size, range(HALF))
    save(root, HALF, model, optimizer, precision, {"strategy": strategy["name"], "world_size": world_size})


def _second(rank, world_size, strategy, start, root):
    """HALF steps from the checkpoint `start` (None: 2 x HALF from the first weights), then a checkpoint."""
    from ddp_lab.rank.checkpoint import load, save

    model, optimizer, precision = _build(strategy, "transformer", seed=rank if start is None else 100 + rank)
    first = 0 if start is None else load(start, model, optimizer, precision).step
    _steps(model, optimizer, precision, rank, world_size, range(first, 2 * HALF))
    save(root, 2 * HALF, model, optimizer, precision, {"strategy": strategy["name"], "world_size": world_size})


def _whole(folder, step, into) -> dict:
    dcp_to_torch_save(checkpoint_path(folder, step), into)
    return torch.load(into)


def _moved_as_straight(tmp_path, step: int = 2 * HALF) -> None:
    """The final checkpoints (at `step`) of the run that moved and the one that did not: parameters and optimizer
    state equal."""
    moved = _whole(tmp_path / "moved", step, tmp_path / "moved.pt")
    straight = _whole(tmp_path / "straight", step, tmp_path / "straight.pt")
    assert set(moved) == set(straight) and any(k.endswith(".exp_avg_sq") for k in moved)
    for key, tensor in straight.items():
        if key.startswith(("model.", "optim.")):
            torch.testing.assert_close(moved[key], tensor, atol=ATOL, rtol=RTOL, msg=lambda msg, k=key: f"{k}: {msg}")


@pytest.mark.parametrize("a, n, b, m", [
    ({"name": "bucketed"}, 2, {"name": "fsdp"}, 3),
    ({"name": "fsdp"}, 2, {"name": "zero1"}, 4),
    ({"name": "zero2"}, 3, {"name": "bucketed"}, 2),
    ({"name": "hsdp", "shard_size": 2}, 4, {"name": "fsdp_torch"}, 2),
    ({"name": "zero1_torch"}, 2, {"name": "zero2"}, 2),
], ids=lambda v: v["name"] if isinstance(v, dict) else str(v))
def test_a_run_moves_between_strategies_and_world_sizes(tmp_path, a, n, b, m):
    run_ranks(_first, n, a, tmp_path / "a")
    run_ranks(_second, m, b, checkpoint_path(tmp_path / "a", HALF), tmp_path / "moved")
    run_ranks(_second, m, b, None, tmp_path / "straight")
    _moved_as_straight(tmp_path)


def _killed_mid_save(rank, world_size, job):
    """A checkpoint after step 1; a step more; SIGKILL once every file of the second save is written, before
    DCP's metadata (its last act) marks it complete."""
    import os
    import signal

    from torch.distributed.checkpoint import FileSystemWriter

    from ddp_lab.rank.checkpoint import save

    model, optimizer, precision = _build({"name": "zero2"}, "transformer", seed=0)
    _steps(model, optimizer, precision, rank, world_size, range(1))
    save(job, 1, model, optimizer, precision, {"strategy": "zero2", "world_size": world_size})
    _steps(model, optimizer, precision, rank, world_size, range(1, 2))
    FileSystemWriter.finish = lambda self, metadata, results: os.kill(os.getpid(), signal.SIGKILL)
    save(job, 2, model, optimizer, precision, {"strategy": "zero2", "world_size": world_size})


def _load_and_save_again(rank, world_size, job):
    from ddp_lab.jobdir import newest_checkpoint
    from ddp_lab.rank.checkpoint import load, save

    model, optimizer, precision = _build({"name": "zero2"}, "transformer", seed=7)
    step = load(newest_checkpoint(job), model, optimizer, precision).step
    save(job, step + 1, model, optimizer, precision, {"strategy": "zero2", "world_size": world_size})
    return step


def test_a_save_killed_mid_write_leaves_no_checkpoint_a_load_takes(tmp_path):
    """The files are there, the checkpoint is not; a load takes the one before, and the next save removes
    what the killed one left."""
    from torch.multiprocessing import ProcessExitedException

    from ddp_lab.jobdir import complete_checkpoints, newest_checkpoint

    with pytest.raises(ProcessExitedException, match="SIGKILL"):
        run_ranks(_killed_mid_save, 1, tmp_path)
    partial = tmp_path / "checkpoints" / "step_2.partial"
    assert any(partial.glob("*.distcp")) and not checkpoint_path(tmp_path, 2).exists()
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [1]
    assert newest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1) and newest_checkpoint(partial) is None
    assert run_ranks(_load_and_save_again, 1, tmp_path)[0] == 1
    assert not partial.exists() and [step for step, _ in complete_checkpoints(tmp_path)] == [1, 2]


def _on_mesh(rank, world_size, strategy, tp, impl, start, root, step_to, pp=1, model_name="transformer", cp=1, ep=1,
             schedule="1f1b", cp_impl="zigzag"):
    """`strategy` on a (pp, dp, cp, tp) mesh (ddp_lab/parallel/; pp > 1: `schedule` over 2 micro-batches, interleaved
    1F1B with 2 stages a rank; cp > 1: `cp_impl`; ep > 1: a mixture's experts split over ep ranks): from
    the checkpoint `start` (None: the first weights, rank-seeded as every run's), steps up to `step_to`, then a
    checkpoint there. `model_name`: a MODELS name, or `moe` (tests/helpers/moe.py's mixture, balanced by the
    bias: state a checkpoint must keep)."""
    from omegaconf import OmegaConf

    from ddp_lab.parallel import Parallelism
    from ddp_lab.rank.checkpoint import as_is, load, save
    from ddp_lab.rank.data import BatchSource
    from ddp_lab.spec.strategies import spec_of
    from ddp_lab.tasks.train import wrap
    from tests.helpers.moe import tiny_moe

    cfg = OmegaConf.merge(data_cfg(1, BATCH), {"world_size": world_size, "parallel": {
        "tp": tp, "tp_impl": impl, "sequence_parallel": tp > 1, "tp_inner": True, "pp": pp, "pp_impl": "lab",
        "pp_schedule": schedule, "microbatches": 2 if pp > 1 else 1,
        "stages_per_rank": 2 if schedule == "interleaved_1f1b" else 1, "stage_layers": None,
        "cp": cp, "cp_impl": cp_impl, "cp_ulysses": 2, "ep": ep, "ep_impl": "lab"}})
    parallel = Parallelism(cfg, torch.device("cpu"))
    torch.manual_seed(rank if start is None else 100 + rank)
    factory = tiny_moe(router="sigmoid", balance="bias", bias_rate=0.01) if model_name == "moe" else MODELS[model_name]
    module = parallel.apply(factory())
    spec = parallel.data_parallel(spec_of(strategy))
    model, optimizer, precision = wrap(spec, module, PRECISION, "cpu", 1e-2, 0.1, group=parallel.group())
    place = parallel.place or as_is
    about = {"strategy": strategy["name"], **parallel.about()}
    first = 0 if start is None else load(start, model, optimizer, precision, about, place).step
    batches = BatchSource(cfg, *parallel.data_shard, torch.device("cpu"), parallel.splits, parallel.columns())
    for step in range(first, step_to):
        parallel.step(model, optimizer, list(batches.micro_batches(step)), precision=precision)
    save(root, step_to, model, optimizer, precision, about, place=place)


@pytest.mark.parametrize("a, b", [
    (({"name": "zero2"}, 4, 2, "lab"), ({"name": "bucketed"}, 4, 1, "lab")),
    (({"name": "zero2"}, 4, 2, "lab"), ({"name": "flat"}, 1, 1, "lab")),
    (({"name": "bucketed"}, 2, 1, "lab"), ({"name": "fsdp_torch"}, 4, 2, "torch")),
    (({"name": "fsdp"}, 4, 2, "torch"), ({"name": "zero1"}, 4, 4, "lab")),
    (({"name": "zero2"}, 4, 1, "lab", 2), ({"name": "bucketed"}, 4, 1, "lab")),
    (({"name": "fsdp_torch"}, 4, 1, "lab", 2), ({"name": "flat"}, 1, 1, "lab")),
    (({"name": "bucketed"}, 2, 1, "lab"), ({"name": "zero1"}, 4, 2, "lab", 2)),
], ids=lambda v: "{}-{}{}x{}-{}".format(v[0]["name"], f"{v[4]}x" if len(v) > 4 else "",
                                        v[1] // v[2] // (v[4] if len(v) > 4 else 1), v[2], v[3]))
def test_a_run_moves_between_meshes(tmp_path, a, b):
    """A checkpoint written on a mesh holds the single-process layout: written at dp x tp = 2 x 2 (the lab's TP,
    sequence parallel) it loads at 4 x 1 and at 1 x 1, and one written without TP loads into torch's TP at
    2 x 2 (and torch's at 2 x 2 into the lab's at 1 x 4); written at pp x dp = 2 x 2 (1F1B) it loads at dp 4 and
    at 1, and one written at dp 2 loads into pp x dp x tp = 2 x 1 x 2; each then trains as a run that never
    moved."""
    run_ranks(_on_mesh, a[1], a[0], a[2], a[3], None, tmp_path / "a", HALF, *a[4:])
    for folder, start in (("moved", checkpoint_path(tmp_path / "a", HALF)), ("straight", None)):
        run_ranks(_on_mesh, b[1], b[0], b[2], b[3], start, tmp_path / folder, 2 * HALF, *b[4:])
    _moved_as_straight(tmp_path)


def test_a_run_moves_off_an_interleaved_pipeline(tmp_path):
    """Two stages a rank (interleaved 1F1B, pp 2 x 2 virtual stages x dp 2, zero2): each rank's two chunks of the
    4-block model are pieces of one single-process layout, so the checkpoint loads at dp 4 without a pipeline and
    trains on as a run that never moved."""
    deep = ("deep_transformer", 1, 1, "interleaved_1f1b")
    run_ranks(_on_mesh, 4, {"name": "zero2"}, 1, "lab", None, tmp_path / "a", HALF, 2, *deep)
    for folder, start in (("moved", checkpoint_path(tmp_path / "a", HALF)), ("straight", None)):
        run_ranks(_on_mesh, 4, {"name": "bucketed"}, 1, "lab", start, tmp_path / folder, 2 * HALF, 1, deep[0])
    _moved_as_straight(tmp_path)


CHAIN = (  # (strategy, pp, pp_schedule, cp, cp_impl) on 4 ranks: each mesh writes the checkpoint the next loads
    ("zero2", 2, "gpipe", 1, "ring"),
    ("zero2", 2, "zero_bubble", 1, "ring"),
    ("bucketed", 1, "1f1b", 2, "ring"),
    ("zero2", 1, "1f1b", 2, "ulysses"),
    ("fsdp_torch", 1, "1f1b", 2, "torch"),
    ("flat", 1, "1f1b", 4, "hybrid"),
)


def _along_the_chain(rank, world_size, root):
    """A step on each mesh of CHAIN in turn, each from the checkpoint the one before wrote (the last in `moved`), and
    the last mesh's run from the start (`straight`): one set of ranks, every mesh's groups built in turn."""
    start = None
    for step, (name, pp, schedule, cp, cp_impl) in enumerate(CHAIN, 1):
        folder = root / ("moved" if step == len(CHAIN) else f"written_at_{step}")
        _on_mesh(rank, world_size, {"name": name}, 1, "lab", start, folder, step, pp, "transformer", cp,
                 schedule=schedule, cp_impl=cp_impl)
        start = checkpoint_path(folder, step)
    _on_mesh(rank, world_size, {"name": name}, 1, "lab", None, root / "straight", len(CHAIN), pp, "transformer", cp,
             schedule=schedule, cp_impl=cp_impl)


def test_a_run_moves_along_every_schedule_and_context_parallel_impl(tmp_path):
    """Written under GPipe (pp 2 x dp 2), it goes on under zero bubble, then at dp 2 x cp 2 under the ring, Ulysses and
    torch's context parallelism (FSDP2), then at cp 4 (hybrid), a step on each, and ends where a run that never moved
    ends: every schedule and cp impl writes the single-process layout and reads it back."""
    run_ranks(_along_the_chain, 4, tmp_path)
    _moved_as_straight(tmp_path, len(CHAIN))


@pytest.mark.parametrize("a, b", [
    (({"name": "fsdp_torch"}, 4, 2), ({"name": "bucketed"}, 4, 1)),
    (({"name": "zero2"}, 4, 2), ({"name": "flat"}, 1, 1)),
    (({"name": "bucketed"}, 2, 1), ({"name": "fsdp_torch"}, 4, 4)),
], ids=lambda v: f"{v[0]['name']}-{v[1] // v[2]}xcp{v[2]}")
def test_a_run_moves_between_context_parallel_meshes(tmp_path, a, b):
    """A checkpoint written at dp x cp = 2 x 2 (FSDP2 sharded over the flattened group, zero2) loads at dp 4 and
    at 1, and one written at dp 2 loads at cp 4: context-parallel ranks hold the whole weights, which a checkpoint
    holds once; each then trains as a run that never moved."""
    (strategy_a, world_a, cp_a), (strategy_b, world_b, cp_b) = a, b
    run_ranks(_on_mesh, world_a, strategy_a, 1, "lab", None, tmp_path / "a", HALF, 1, "transformer", cp_a)
    for folder, start in (("moved", checkpoint_path(tmp_path / "a", HALF)), ("straight", None)):
        run_ranks(_on_mesh, world_b, strategy_b, 1, "lab", start, tmp_path / folder, 2 * HALF, 1, "transformer", cp_b)
    _moved_as_straight(tmp_path)


@pytest.mark.parametrize("a, b", [
    (({"name": "bucketed"}, 4, 2), ({"name": "flat"}, 4, 4)),
    (({"name": "flat"}, 4, 4), ({"name": "bucketed"}, 2, 1)),
    (({"name": "bucketed"}, 2, 1), ({"name": "zero2"}, 1, 1)),
], ids=lambda v: f"{v[0]['name']}-{v[1]}ranks-ep{v[2]}")
def test_a_mixture_moves_between_expert_parallel_sizes(tmp_path, a, b):
    """A checkpoint of a mixture written at ep 2 of 4 ranks loads at ep 4, one at ep 4 loads at ep 1 on 2 ranks, and
    one at ep 1 into zero2 on one rank: the experts resharded (each rank's run of them is a piece of the whole
    tensor), the selection bias kept; each then trains as a run that never moved."""
    (strategy_a, world_a, ep_a), (strategy_b, world_b, ep_b) = a, b
    run_ranks(_on_mesh, world_a, strategy_a, 1, "lab", None, tmp_path / "a", HALF, 1, "moe", 1, ep_a)
    for folder, start in (("moved", checkpoint_path(tmp_path / "a", HALF)), ("straight", None)):
        run_ranks(_on_mesh, world_b, strategy_b, 1, "lab", start, tmp_path / folder, 2 * HALF, 1, "moe", 1, ep_b)
    _moved_as_straight(tmp_path)


def _tied_across_stages(rank, world_size, root, step_to, start=None):
    """tied_toy cut in two (its embedding on one stage, the head tied to it on the other), saved."""
    _on_mesh(rank, world_size, {"name": "zero2"}, 1, "lab", start, root, step_to, pp=2, model_name="tied_toy")


def test_a_weight_tied_across_stages_is_saved_once_as_one_process_names_it(tmp_path):
    """The two stages' copies of a tied weight are one entry of the checkpoint, under its first name, and the
    run loads it back at one rank (where the two names are one parameter again) and trains on as a run that
    never moved."""
    run_ranks(_tied_across_stages, 2, tmp_path / "a", HALF)
    names = set(_whole(tmp_path / "a", HALF, tmp_path / "a.pt"))
    model = MODELS["tied_toy"]()
    assert {f"model.{n}" for n, _ in model.named_parameters()} == {n for n in names if n.startswith("model.")}
    run_ranks(_on_mesh, 1, {"name": "flat"}, 1, "lab", checkpoint_path(tmp_path / "a", HALF), tmp_path / "moved",
              2 * HALF, 1, "tied_toy")
    run_ranks(_on_mesh, 1, {"name": "flat"}, 1, "lab", None, tmp_path / "straight", 2 * HALF, 1, "tied_toy")
    _moved_as_straight(tmp_path)
