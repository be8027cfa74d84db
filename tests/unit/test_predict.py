"""The step-time predictor: fits recover known constants, replays of hand-made schedules give the
hand-computed step, strategy schedules and `scale` figures match hand arithmetic, bad input is refused."""

import functools
import json
import subprocess
import sys

import pytest

from ddp_lab.analysis.predict import fit as fitting
from ddp_lab.analysis.predict import scale as scaling
from ddp_lab.analysis.predict.cli import main
from ddp_lab.analysis.predict.costs import PredictError, collective_ms, share_speeds
from ddp_lab.analysis.predict.interpret import planned_units
from ddp_lab.analysis.predict.nccl import collective_s, options
from ddp_lab.analysis.predict.replay import Collective, Step, replay
from ddp_lab.analysis.predict.scale import load_model, step_ms
from ddp_lab.analysis.predict.schedule import best_bucket_mb, job_step
from ddp_lab.analysis.predict.systems import SYSTEMS
from ddp_lab.models.facts import flops_per_token
from ddp_lab.spec.figures import FWD_BWD, OPTIMIZER
from tests.helpers.launching import ROOT
from tests.helpers.report_fixtures import collective_results, train_results, write_job

# --- fits -------------------------------------------------------------------------------------------


def test_collective_fit_recovers_known_alpha_beta_per_world_size_and_the_ring_form(tmp_path):
    i = 0
    alpha_step, busbw = 0.3e-3, 1.2e9  # ring form: 2(n-1) * alpha_step + 2(n-1)/n * bytes / busbw
    for n in (2, 4, 6):
        for mb in (0.001, 0.1, 1, 10, 40):  # per world size: alpha = 2(n-1) alpha_step, beta = busbw n / 2(n-1)
            write_job(tmp_path / str(i), collective_results(mb, 2 * (n - 1) * alpha_step, busbw * n / (2 * (n - 1)),
                                                            world_size=n))
            i += 1
    fits = fitting.fit_collectives(tmp_path)["gloo"]["all_reduce"]["fp32"]
    for n in (2, 4, 6):
        f = fits["by_world_size"][str(n)]
        assert f["alpha_ms"] == pytest.approx(2 * (n - 1) * alpha_step * 1e3, rel=0.02)
        assert f["beta_GBps"] == pytest.approx(busbw * n / (2 * (n - 1)) / 1e9, rel=0.02)
    assert fits["ring"]["alpha_step_ms"] == pytest.approx(alpha_step * 1e3, rel=0.02)
    assert fits["ring"]["busbw_GBps"] == pytest.approx(busbw / 1e9, rel=0.02)
    # a world size the sweep never ran comes from the ring form
    ms = collective_ms(fitting.fit_collectives(tmp_path), "gloo", "all_reduce", 8e6, 8)
    assert ms == pytest.approx((14 * alpha_step + 14 / 8 * 8e6 / busbw) * 1e3, rel=0.02)
    # gloo on 4 cores: fitted up to 6 ranks (4 cores each 4/6 of one), 8 ranks get 1/2: x 4/3
    on_cores = collective_ms(fitting.fit_collectives(tmp_path), "gloo", "all_reduce", 8e6, 8, cpus=4)
    assert on_cores == pytest.approx(ms * (4 / 6) / (4 / 8))
    assert collective_ms(fitting.fit_collectives(tmp_path), "gloo", "all_reduce", 8e6, 8,
                         cpus=64) == pytest.approx(ms)  # cores enough: nothing changes


def test_back_to_back_calls_fit_apart_and_time_naive(tmp_path):
    # the same op timed with a barrier before each call (alpha 1 ms) and back to back (alpha 3 ms)
    for i, mb in enumerate((0.001, 1, 10)):
        write_job(tmp_path / f"a{i}", collective_results(mb, 1e-3, 1e9))
        write_job(tmp_path / f"b{i}", collective_results(mb, 3e-3, 1e9, barrier=False))
    fits = fitting.fit_collectives(tmp_path)
    entry = fits["gloo"]["all_reduce"]["fp32"]
    assert entry["by_world_size"]["2"]["alpha_ms"] == pytest.approx(1.0, rel=0.02)
    assert entry["back_to_back"]["by_world_size"]["2"]["alpha_ms"] == pytest.approx(3.0, rel=0.02)
    alone, chained = (collective_ms(fits, "gloo", "all_reduce", 1e6, 2, back_to_back=b) for b in (False, True))
    assert chained - alone == pytest.approx(2.0, rel=0.02)
    # naive's blocking calls follow each other: two 1 MB all-reduces at 3 + 1 ms each, not 1 + 1
    model = _model()
    model["collectives"]["gloo"]["all_reduce"]["fp32"]["back_to_back"] = {
        "by_world_size": {"2": {"alpha_ms": 3.0, "beta_GBps": 1.0}}}
    assert job_step(model, _cfg("naive"))[1].exposed_ms == pytest.approx(8.0)
    assert job_step(model, _cfg("overlap"))[1].exposed_ms == pytest.approx(2.0)  # async: alone, as before


def test_profile_work_removes_the_slowdown_of_comm_in_flight():
    # backward from 11 to 41 ms; comm in flight 21-41: with compute 2x slower then, 20 ms of work
    step = {"step": 3, "profiled": False, "end_ms": 50.0, "forward_ms": [1.0, 11.0],
            "laps_ms": {"fwd_bwd_ms": 41.0, "sync_ms": 44.0, "optimizer_ms": 49.0},
            "ready_ms": [41.0, 31.0], "comm_ms": [[21.0, 44.0]]}
    phases = {"params": [{"name": "a", "numel": 1, "bytes": 4, "dtype": "float32"}] * 2,
              "ranks": [[step, {**step, "step": 4}], [step, {**step, "step": 4}]]}
    prof = fitting.compute_profile(phases, warmup=3, compute_slowdown=2.0)
    assert prof["forward"] == 10.0 and prof["backward"] == 20.0 and prof["backward_wall"] == 30.0
    assert prof["ready"] == [20.0, 15.0]
    assert prof["exposed"] == 3.0 and prof["optimizer"] == 5.0 and prof["other"] == 2.0
    assert prof["hidden"] == 20.0


def test_profile_work_less_launches_and_the_fit_pinned_by_compute_alone():
    # backward 11-71 ms (wall 60), comm in flight 31-50: at compute x2 that is 60 - 9.5 = 50.5 ms of work,
    # less 1.5 ms for the one launch made during backward (at 31, before b's ready mark was read)
    step = {"step": 3, "profiled": False, "end_ms": 90.0, "forward_ms": [1.0, 11.0],
            "laps_ms": {"fwd_bwd_ms": 71.0, "sync_ms": 74.0, "optimizer_ms": 89.0},
            "ready_ms": [71.0, 31.0], "comm_ms": [[31.0, 50.0], [72.0, 74.0]]}
    phases = {"params": [{"name": "a", "numel": 1, "bytes": 4, "dtype": "float32"}] * 2,
              "ranks": [[step, {**step, "step": 4}]] * 2}
    prof = fitting.compute_profile(phases, warmup=3, compute_slowdown=2.0, launch_ms=1.5)
    assert prof["launches"] == 1 and prof["backward"] == pytest.approx(49.0)
    assert prof["ready"] == [pytest.approx(49.0), pytest.approx(18.5)]  # b: 20 ms of wall, less its launch
    phases["compute_alone"] = [[{"forward_ms": 10.0, "backward_ms": b} for b in (45.0, 44.0, 60.0)],
                               [{"forward_ms": 10.0, "backward_ms": b} for b in (47.0, 40.0, 41.0)]]
    assert fitting.backward_alone_ms(phases) == 47.0  # passes as long as their slowest rank: 47, 44, 60
    assert fitting.backward_alone_ms({"ranks": []}) is None


def test_fit_recovers_slowdown_and_launch_cost_from_a_synthetic_profile(tmp_path):
    # a profile made by the replay itself from known constants: the fit must find them again
    truth = _model()
    truth["contention"] = {"u": 1.0, "compute_slowdown": 2.0, "comm_slowdown": 2.0, "launch_ms": 3.0}
    cfg = {**_cfg("overlap"), "train": {"batch_size": 8, "warmup_steps": 0, "steps": 2, "precision": "fp32"}}
    step, r = job_step(truth, cfg)
    # overlap launches b (ready at 10 ms of work) then a (20, the end): backward is 20 + 2 x 3 of work.
    # b launches at 13 of work (wall 13), runs 4 (2 alone, x2) while backward does 2: work 15 at wall 17;
    # the rest alone: 11 more. a launches at the end and runs its 2 ms exposed.
    assert r.backward_end_ms == pytest.approx(28.0) and r.hidden_ms == pytest.approx(4.0)
    assert r.exposed_ms == pytest.approx(2.0)
    end = 10 + r.backward_end_ms  # what the profiler would record: ready times after each hook's launch
    rec = {"step": 0, "profiled": False, "forward_ms": [0.0, 10.0],
           "laps_ms": {"fwd_bwd_ms": end, "sync_ms": end + 2, "optimizer_ms": end + 7}, "end_ms": end + 8,
           "ready_ms": [end, 23.0], "comm_ms": [[23.0, 27.0], [end, end + 2]]}
    phases = {"params": [{k: v for k, v in p.items() if k != "ready_ms"} for p in truth["compute"]["params"]],
              "cpus": 2, "threads_per_rank": 1, "ranks": [[rec, {**rec, "step": 1}]] * 2,
              "compute_alone": [[{"forward_ms": 10.0, "backward_ms": 20.0}]] * 2}
    job = tmp_path / "prof"
    job.mkdir()
    (job / "phases.json").write_text(json.dumps(phases))
    write_job(job, {"status": "ok", "config": {**cfg, "profile": True}, "env": {"backend": "gloo"}})
    compute, contention = fitting.fit_profile(job, truth["collectives"])
    assert contention["compute_slowdown"] == pytest.approx(2.0) and contention["launch_ms"] == pytest.approx(3.0)
    assert compute["backward_ms"] == pytest.approx(20.0)
    assert "compute_alone" in contention["identified_by"]


def test_fit_carries_what_the_phases_leave_unexplained(tmp_path):
    # three steps: backward 20, 20, 30 ms and optimizer 5, 15, 5: steps of 36, 46, 46 (forward 10,
    # rest 1): median 46, while the medians of the phases add up to 36. The 10 ms are carried as other.
    def rec(step, backward, optimizer):
        end = 10 + backward
        return {"step": step, "profiled": False, "forward_ms": [0.0, 10.0], "ready_ms": [end, end],
                "laps_ms": {"fwd_bwd_ms": end, "sync_ms": end, "optimizer_ms": end + optimizer},
                "end_ms": end + optimizer + 1, "comm_ms": []}
    steps = [rec(0, 20, 5), rec(1, 20, 15), rec(2, 30, 5)]
    phases = {"params": [{"name": "w", "numel": 1, "bytes": 4, "dtype": "float32"}] * 2, "cpus": 2,
              "threads_per_rank": 1, "ranks": [steps, steps],
              "compute_alone": [[{"forward_ms": 10.0, "backward_ms": 20.0}]] * 2}
    cfg = {**_cfg("naive", world_size=1), "train": {"batch_size": 8, "warmup_steps": 0, "steps": 3}}
    job = tmp_path / "prof"
    job.mkdir()
    (job / "phases.json").write_text(json.dumps(phases))
    write_job(job, {"status": "ok", "config": {**cfg, "profile": True}, "env": {"backend": "gloo"}})
    compute, _ = fitting.fit_profile(job, _model()["collectives"])
    assert compute["unexplained_ms"] == pytest.approx(10.0) and compute["other_ms"] == pytest.approx(11.0)


def test_share_speeds_processor_sharing():
    two = share_speeds(ranks=2, cpus=2, threads_per_rank=1, u=0.5)
    assert two["compute_slowdown"] == pytest.approx(1.5) and two["comm_slowdown"] == pytest.approx(1.5)
    four = share_speeds(ranks=4, cpus=2, threads_per_rank=1, u=0.5)
    assert four["compute_alone"] == 0.5 and four["compute_slowdown"] == pytest.approx(1.5)
    assert four["comm_slowdown"] == pytest.approx(3.0)  # comm alone at 4 ranks: 2 cores for 2 threads' worth
    assert share_speeds(1, 2, 1, 0.5)["compute_slowdown"] == 1.0  # spare cores: nobody waits


# --- replay -----------------------------------------------------------------------------------------

def test_replay_serial_fully_hidden_partly_hidden():
    serial = replay(Step(10, 100, [Collective(20, None)], optimizer_ms=5, other_ms=1))
    assert (serial.step_ms, serial.exposed_ms, serial.hidden_ms) == (136, 20, 0)
    hidden = replay(Step(10, 100, [Collective(20, 30)], optimizer_ms=5, other_ms=1))
    assert (hidden.step_ms, hidden.exposed_ms, hidden.hidden_ms) == (116, 0, 20)
    partly = replay(Step(10, 100, [Collective(20, 90)], optimizer_ms=5, other_ms=1))
    assert (partly.step_ms, partly.exposed_ms, partly.hidden_ms) == (126, 10, 10)


def test_replay_charges_each_launch_from_backward_to_compute():
    # two launches of 1 ms each: backward 100 -> 102 of work; the second collective (ready at 60)
    # launches at 62 and runs 20 alone: ends at 82, hidden
    r = replay(Step(0, 100, [Collective(5, 10), Collective(20, 60)], launch_ms=1.0))
    assert r.backward_end_ms == pytest.approx(102) and r.exposed_ms == 0 and r.hidden_ms == pytest.approx(25)
    late = replay(Step(0, 100, [Collective(20, 100)], launch_ms=1.0))  # launched at 101, after 101 of work
    assert late.backward_end_ms == pytest.approx(101) and late.exposed_ms == pytest.approx(20)


def test_replay_gate_makes_compute_wait():
    # needed at 10 of work, 30 long: 10 of it runs under compute, then backward waits 20
    r = replay(Step(0, 100, [Collective(30, 0, "gather", needed_ms=10)]))
    assert (r.backward_end_ms, r.stalled_ms, r.hidden_ms, r.exposed_ms) == (120, 20, 10, 20)


def test_fsdp_schedule_hand_computed_on_the_strategys_own_plan():
    # UnitsNet's plan (spec/strategies/fsdp_units.py): units embed (a lookup: no forward work, not gathered
    # for backward), blocks.0, blocks.1, head (kept after forward); the root holds norm.weight (replicated).
    model = _model()
    one = {"numel": 250000, "bytes": 1e6, "dtype": "float32"}
    model["compute"].update(forward_ms=30.0, params=[
        {**one, "name": "embed.weight", "ready_ms": 20.0}, {**one, "name": "blocks.0.weight", "ready_ms": 15.0},
        {**one, "name": "blocks.1.weight", "ready_ms": 10.0},
        {"numel": 16, "bytes": 64.0, "dtype": "float32", "name": "norm.weight", "ready_ms": 5.0},
        {**one, "name": "head.weight", "ready_ms": 5.0}])
    cfg = {**_cfg("fsdp"), "model": {"_target_": "ddp_lab.check.models.UnitsNet", "name": "tiny",
                                    "context_length": 64}}
    units, root = planned_units(cfg["model"], model["compute"]["params"], "linear_embedding")
    assert [(u.name, u.needed_in_backward, u.weight) for u in units] == [
        ("embed", False, 0), ("blocks.0", True, 250000), ("blocks.1", True, 250000), ("head", True, 250000)]
    assert (root.name, root.sharded, root.replicated) == ("", (), (3,))
    # a gather or reduce-scatter of 1 MB at 2 ranks: 2 broadcasts of 0.5 MB, 1.5 ms each = 3 ms; the
    # root's all-reduce of 64 bytes: 1 ms (the norm's 16 weights' share of forward: nothing to 1e-3 ms).
    # Forward (10 ms per matmul unit): embed's and blocks.0's gathers waited for at 0 (6 ms); blocks.1's
    # (launched as blocks.0 starts) and head's hidden: 36 ms.
    # Backward: blocks.1's gather 0-3 hidden; at 5 head's reduce-scatter 5-8, blocks.0's gather 8-11,
    # waited for from 10 (1 ms); blocks.1's reduce-scatter at 10 (11-14), blocks.0's at 15 (16-19);
    # backward ends at 21; embed's reduce-scatter and the root's all-reduce after it: 4 ms.
    # Optimizer on half: 2.5, the rest 1.
    model["host"]["fresh_copy_GBps"] = float("inf")  # the strategy's host copies cost nothing here (below)
    close = functools.partial(pytest.approx, abs=1e-2)
    step, r = job_step(model, cfg)
    assert [c.label for c in step.collectives] == [
        "gather blocks.1 again", "reduce-scatter head", "gather blocks.0 again", "reduce-scatter blocks.1",
        "reduce-scatter blocks.0", "reduce-scatter embed", "all-reduce root's replicated"]
    assert step.forward_ms == close(36.0)
    assert r.step_ms == close(36 + 21 + 4 + 2.5 + 1)
    assert r.exposed_ms == close(6 + 1 + 4) and r.stalled_ms == close(7.0)
    kept = job_step(model, {**cfg, "strategy": {"name": "fsdp", "reshard_after_forward": False}})[1]
    assert kept.step_ms == close(36 + 20 + 4 + 2.5 + 1)  # no gathers in backward, no wait
    # host copies into new storage at 0.5 GB/s (2 ms a MB): forward copies out 4 MB (8 ms of work; the
    # gathers still waited for at 0, then hidden: 6 + 38); backward copies out blocks.0 and blocks.1
    # again and folds 4 MB of gradients (12 ms), its work stretched to 32
    model["host"]["fresh_copy_GBps"] = 0.5
    step = job_step(model, cfg)[0]
    assert (step.forward_ms, step.backward_ms) == (close(44.0), close(32.0))


def test_replay_queue_order_and_slowdown():
    # second waits for the first: 10-40, 40-70; backward ends at 50: 20 exposed
    q = replay(Step(0, 50, [Collective(30, 10), Collective(30, 20)]))
    assert q.exposed_ms == pytest.approx(20) and q.step_ms == pytest.approx(70)
    # launch order is kept even if a later unit is ready first: it cannot start before the first
    o = replay(Step(0, 50, [Collective(10, 40), Collective(10, 5)]))
    assert o.exposed_ms == pytest.approx(10)  # 40-50, 50-60
    # both 2x slower while overlapping: comm from 90: 10 work left takes 20 ms, comm does 10 of 20
    s = replay(Step(10, 100, [Collective(20, 90)], optimizer_ms=5, other_ms=1, compute_slowdown=2, comm_slowdown=2))
    assert (s.backward_end_ms, s.exposed_ms, s.step_ms) == (pytest.approx(110), pytest.approx(10), pytest.approx(136))
    with pytest.raises(ValueError):
        replay(Step(0, 10, [Collective(1, 11)]))


# --- strategy schedules on a hand-made model --------------------------------------------------------

def _model(u=0.0):
    fit = {"alpha_ms": 1.0, "beta_GBps": 1.0}  # 1 MB: 1 + 1 ms
    return {"collectives": {"gloo": {op: {"fp32": {"by_world_size": {"2": fit, "4": fit}}}
                                     for op in ("all_reduce", "broadcast")}},
            "compute": {"model": "tiny", "strategy": "overlap", "world_size": 2, "backend": "gloo", "cpus": 2,
                        "threads_per_rank": 1, "tokens_per_rank": 4 * 64,
                        "params": [{"name": "a", "numel": 250000, "bytes": 1e6, "dtype": "float32", "ready_ms": 20.0},
                                   {"name": "b", "numel": 250000, "bytes": 1e6, "dtype": "float32", "ready_ms": 10.0}],
                        "forward_ms": 10.0, "backward_ms": 20.0, "optimizer_ms": 5.0, "other_ms": 1.0},
            "contention": {"u": u}, "host": {"copy_GBps": 1.0, "fresh_copy_GBps": 0.5}}


def _cfg(strategy, world_size=2, **knobs):
    return {"model": {"name": "tiny", "context_length": 64}, "train": {"batch_size": 8}, "world_size": world_size,
            "strategy": {"name": strategy, **knobs}}


@pytest.mark.parametrize("strategy, knobs, step, exposed", [
    ("naive", {}, 40.0, 4.0),                        # two 2 ms all-reduces after backward
    ("overlap", {}, 38.0, 2.0),                      # b at 10-12 hidden, a at 20-22 exposed
    ("bucketed", {"bucket_mb": 25}, 39.0, 3.0),      # one 2 MB bucket: 1 + 2 ms after backward
    ("bucketed", {"bucket_mb": 1}, 38.0, 2.0),       # one parameter per bucket, as overlap
    ("flat", {}, 45.0, 9.0),                         # 3 ms all-reduce + 2 MB into a new buffer at 0.5 GB/s, back at 1
    ("zero1", {"bucket_mb": 25}, 40.5, 7.0),         # bucketed, optimizer on half, then 2 broadcasts of 2 ms
    # one reduce-scatter of both tensors after backward, one all-gather after the update; with no fit of
    # either, each is 2 calls (reduces timed as broadcasts) of 1 MB: 4 ms
    ("zero1", {"comm": "reduce_scatter"}, 10 + 20 + 4 + 2.5 + 4 + 1, 8.0),
])
def test_strategy_schedules_hand_computed(strategy, knobs, step, exposed):
    _, r = job_step(_model(), _cfg(strategy, **knobs))
    assert r.step_ms == pytest.approx(step) and r.exposed_ms == pytest.approx(exposed)


def test_gradients_in_buckets_pay_the_zeroing_and_the_adds():
    # bucketed's gradients are bucket slices: 2 MB zeroed before forward at 2 GB/s (1 ms), then autograd adds
    # b's gradient (ready at 10) and a's (at 20) into their slices at 1 GB/s: backward 10-11, 21-22, 22 long;
    # the one 2 MB bucket (3 ms) launched at 22: 11 + 22 + 3 + 5 + 1
    model = _model()
    model["host"].update(add_GBps=1.0, zero_GBps=2.0)
    step, r = job_step(model, _cfg("bucketed", bucket_mb=25))
    assert (step.forward_ms, step.backward_ms) == (pytest.approx(11.0), pytest.approx(22.0))
    assert r.step_ms == pytest.approx(42.0)
    assert job_step(model, _cfg("overlap"))[1].step_ms == pytest.approx(38.0)  # autograd keeps its own tensors
    assert job_step(_model(), _cfg("bucketed", bucket_mb=25))[1].step_ms == pytest.approx(39.0)  # an older model file


def test_zero2_times_its_reductions_as_reduces_where_swept():
    # one 2 MB bucket, ready at 20: 2 reduces of 1 MB after backward, the update of half, 2 broadcasts
    # of 1 MB. Without a reduce fit a reduce is timed as a broadcast (1 + 1 ms): 20 + 4 exposed.
    model = _model()
    _, r = job_step(model, _cfg("zero2", bucket_mb=25))
    assert (r.exposed_ms, r.step_ms) == (pytest.approx(8.0), pytest.approx(10 + 20 + 4 + 2.5 + 4 + 1))
    model["collectives"]["gloo"]["reduce"] = {"fp32": {"by_world_size": {"2": {"alpha_ms": 2.0, "beta_GBps": 1.0}}}}
    _, r = job_step(model, _cfg("zero2", bucket_mb=25))  # reduces at 2 + 1 ms each
    assert (r.exposed_ms, r.step_ms) == (pytest.approx(10.0), pytest.approx(10 + 20 + 6 + 2.5 + 4 + 1))


def test_world_size_scales_compute_by_tokens_and_core_share():
    # 4 ranks on 2 cores: half the tokens per rank, half a core each: the same compute
    _, r = job_step(_model(), _cfg("naive", world_size=4))
    assert r.step_ms == pytest.approx(10 + 20 + 4 + 5 * 2 + 1 * 2)  # optimizer and the rest: whole model, half a core
    best, steps = best_bucket_mb(_model(), _cfg("bucketed", bucket_mb=25), [1, 25])
    assert best == 1 and steps == {1.0: pytest.approx(38.0), 25.0: pytest.approx(39.0)}
    with pytest.raises(PredictError, match="model"):
        job_step(_model(), {**_cfg("naive"), "model": {"name": "small"}})
    with pytest.raises(PredictError, match="no replay"):
        job_step(_model(), _cfg("fsdp_torch"))
    with pytest.raises(PredictError, match="unit plan"):  # the hand-made profile names no model to plan
        job_step(_model(), _cfg("fsdp"))
    with pytest.raises(PredictError, match="train.precision"):
        job_step(_model(), {**_cfg("naive"), "train": {"batch_size": 8, "precision": "bf16"}})


# --- scale ------------------------------------------------------------------------------------------

def _opt(system, op, nbytes, n, name):
    return dict((a, t) for t, a in options(system, op, nbytes, n))[name]


def test_nccl_protocols_by_hand():
    h100 = SYSTEMS["h100-nvlink"]
    gib = 2**30
    # ring, 8 GPUs on NVLink: base + 14 steps x hop; bus bandwidth 370.8 GB/s x n / (2(n - 1))
    assert _opt(h100, "all_reduce", gib, 8, "ring/Simple") == pytest.approx((8.4 + 14 * 3.4) * 1e-6
                                                                            + gib / (370.8e9 * 8 / 14))
    assert _opt(h100, "all_reduce", 8, 8, "ring/LL") == pytest.approx((6.6 + 14 * 0.6) * 1e-6 + 8 / (141e9 * 8 / 14))
    assert _opt(h100, "all_reduce", gib, 8, "ring/LL128") == pytest.approx(
        (14.0 + 14 * 1.9) * 1e-6 + gib / (370.8e9 * 0.92 * 8 / 14))
    # NVLS: 25 us, 0.85 x 15/16 of NVLink over S (1 + 1/n) of traffic, a 16 MiB pipeline fill
    nvls_bw = 370.8e9 * 0.85 * 15 / 16 / (1 + 1 / 8)
    assert _opt(h100, "all_reduce", gib, 8, "nvls/Simple") == pytest.approx(25e-6 + (gib + 16 * 2**20) / nvls_bw)
    # the regimes NVIDIA's sweep goes through: LL, then LL128, then NVLS
    assert [collective_s(h100, "all_reduce", b, 8)[1] for b in (2**10, 2**23, gib)] == \
        ["ring/LL", "ring/LL128", "nvls/Simple"]
    # two nodes: 2 of the 30 steps cross the network (hop at least 3 us inside for Simple), the plateau x1.9;
    # no NVLS and no LL128 across nodes
    assert _opt(h100, "all_reduce", gib, 16, "ring/Simple") == pytest.approx(
        (8.4 + 28 * 3.4 + 2 * 14.0) * 1.9e-6 + gib * 30 / 16 / 370.8e9)
    assert {a for _, a in options(h100, "all_reduce", gib, 16)} == {"ring/LL", "ring/Simple", "tree/LL",
                                                                    "tree/LL128", "tree/Simple"}
    assert {a for _, a in options(h100, "all_gather", gib, 8)} == {"ring/LL", "ring/LL128", "ring/Simple"}
    small, algo_small = collective_s(h100, "all_reduce", 1024, 512)
    assert algo_small.startswith("tree") and small < _opt(h100, "all_reduce", 1024, 512, "ring/LL")


def test_scale_step_by_hand_on_one_gpu_and_eight():
    h100 = SYSTEMS["h100-nvlink"]
    cfg = load_model("tiny")
    # tiny: V 10000, d 256, d_ff 1024, 4 layers, context 64; forward FLOPs/token = 2 * matmul weights
    # + 4 * layers * context * d = 2 * (4 * (4 * 256^2 + 3 * 256 * 1024) + 10000 * 256) + 4 * 4 * 64 * 256
    fwd_per_token = 2 * (4 * (4 * 256**2 + 3 * 256 * 1024) + 10000 * 256) + 4 * 4 * 64 * 256
    rate = 989.4e12 * 0.5
    n_params = 2 * 10000 * 256 + 4 * (4 * 256**2 + 3 * 256 * 1024 + 2 * 256) + 256
    tokens = 4 * 64
    one = step_ms(h100, cfg, 1, "bucketed", batch=4)
    assert one["step_ms"] == pytest.approx((3 * fwd_per_token * tokens / rate + 28 * n_params / 3.35e12) * 1e3)
    assert one["exposed_ms"] == 0
    flat = step_ms(h100, cfg, 8, "flat", batch=4)
    grads = 2 * n_params
    comm = collective_s(h100, "all_reduce", grads, 8)[0] + 4 * grads / 3.35e12
    assert flat["exposed_ms"] == pytest.approx(comm * 1e3)
    assert flat["step_ms"] == pytest.approx(one["step_ms"] + comm * 1e3)


# --- bad input --------------------------------------------------------------------------------------

def test_the_command_is_its_cli():
    """`python -m ddp_lab.predict` runs cli.main (the tests call main itself, in process)."""
    out = subprocess.run([sys.executable, "-m", "ddp_lab.predict", "--help"], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.startswith("usage: python -m ddp_lab.predict") and "validate" in out.stdout


def test_scale_prints_a_row_per_strategy_and_world_size(capsys):
    assert main(["scale", "--system", "h100-nvlink", "--model", "xl", "--world-size", "8,64",
                 "--strategy", "bucketed,fsdp"]) == 0
    out = capsys.readouterr().out
    assert "| bucketed | 64 |" in out and "| fsdp | 8 |" in out and "anchor" not in out
    assert main(["scale", "--model", "toy", "--world-size", "8", "--strategy", "torch_ddp,zero2"]) == 0  # any model
    assert "| torch_ddp | 8 |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["scale", "--system", "tpu-v9"], "unknown system"),
    (["scale", "--model", "gpt5"], "unknown model"),
    (["scale", "--world-size", "0,8"], "world sizes must be >= 1"),
    (["scale", "--strategy", "powersgd"], "scale does not replay strategy 'powersgd'"),
    (["scale", "--strategy", "fsdp_torch"], "scale does not replay strategy 'fsdp_torch'"),
])
def test_scale_bad_input(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_bucket_choice_is_scored_against_chance(monkeypatch):
    from ddp_lab.analysis.predict import validate as validating

    measured = {1: 30.0, 2: 25.0, 4: 20.0, 8: 22.0, 16: 28.0}
    predicted = {1: 31.0, 2: 26.0, 4: 23.0, 8: 21.0, 16: 29.0}
    monkeypatch.setattr(validating, "best_bucket_mb", lambda model, cfg, sizes: (8.0, predicted))
    rows = [{"task": "train", "strategy": "bucketed", "model": "tiny", "world_size": 2, "backend": "gloo",
             "bucket_mb": float(mb), "step_p50_ms": ms, "config": {}} for mb, ms in measured.items()]
    (c,) = validating.bucket_checks({}, rows)
    assert (c["measured_best_mb"], c["predicted_best_mb"], c["steps_apart"]) == (4.0, 8.0, 1)
    assert c["loss"] == pytest.approx(22 / 20 - 1)                       # what taking 8 MiB costs
    assert c["chance_loss"] == pytest.approx((0.5 + 0.25 + 0 + 0.1 + 0.4) / 5)  # a size drawn at random
    assert c["rho"] == pytest.approx(0.9)  # two neighbours swapped: 1 - 6 * 2 / (5 * 24)
    assert c["chance_of_rho"] == pytest.approx(5 / 120)  # the identity and the 4 swaps of neighbours
    assert validating.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    line = validating.summary_lines([], [c])[-1]
    assert "costs 10.0% (a random size: 25.0%)" in line and "rho +0.90, 4.2% of random orders" in line


def test_exposed_comm_is_scored_against_the_least_waiting_rank_where_it_is_not_noise(tmp_path):
    from ddp_lab.analysis.predict import validate as validating
    from tests.helpers.report_fixtures import train_results

    for i, (strategy, exposed) in enumerate((("naive", 5.0), ("overlap", 0.5), ("flat", 6.0))):
        res = train_results(strategy, step_ms=50.0, exposed_ms=exposed)  # overlap: 1% of the step, not scored
        res["config"]["train"], res["config"]["model"]["context_length"] = {"batch_size": 8}, 64
        if strategy == "naive":  # the rank that ended backward last waited 4 ms, the other 5 (1 ms of skew)
            res["summary"]["exposed_comm_min_rank_ms"] = {"p50": 4.0}
        write_job(tmp_path / str(i), res)
    rows, notes = validating.predict_records(_model(), tmp_path)
    by = {r["strategy"]: r for r in rows}
    assert by["naive"]["exposed_basis"] == "least-waiting rank" and by["naive"]["exposed_error"] == pytest.approx(0)
    assert by["flat"]["exposed_basis"] == "most-waiting rank"  # results from before the least-waiting figure
    assert by["flat"]["exposed_error"] == pytest.approx((9.0 - 6.0) / 6.0)  # predicted: 3 ms + the copies, 6 ms
    assert by["overlap"]["exposed_error"] is None and not notes
    assert validating.mean_abs_error(rows, "exposed_error") == pytest.approx(0.25)
    md = validating.markdown(rows, [], [])
    assert "| naive | 1 | 20.0% | 0.0% (1) |" in md and "| overlap | 1 | 24.0% | - (0) |" in md
    assert "| 4.0 / 5.0 | 4.0 | +0.0% |" in md and "| ? / 6.0 | 9.0 | +50.0% |" in md
    assert "against the least-waiting rank or most-waiting rank's p50" in md


def test_fit_and_validate_bad_input(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["fit", str(empty), str(empty), "-o", str(tmp_path / "m.json")]) == 2
    assert "no finished collective benchmark" in capsys.readouterr().err
    coll = tmp_path / "coll"
    for i, mb in enumerate((1, 10)):
        write_job(coll / str(i), collective_results(mb, 1e-3, 1e9))
    assert main(["fit", str(coll), str(empty), "-o", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no profiled training run" in err[0]
    (tmp_path / "bad.json").write_text(json.dumps({"hello": 1}))
    assert main(["validate", str(tmp_path / "bad.json"), str(coll)]) == 2
    assert "not a model file" in capsys.readouterr().err


def test_report_shows_the_prediction_beside_the_measurement(tmp_path):
    from ddp_lab.analysis.report import make_report
    from tests.helpers.report_fixtures import train_results

    res = train_results("naive", step_ms=50.0, exposed_ms=5.0)
    res["config"]["train"] = {"batch_size": 8}
    res["config"]["model"]["context_length"] = 64
    write_job(tmp_path / "sweep" / "0", res)
    model = fitting.save({**_model(), "version": fitting.VERSION}, tmp_path / "model.json")
    report = make_report(tmp_path / "sweep", model=model, quiet=True)
    assert "## Predicted vs measured" in report["md"].read_text()
    (row,) = report["records"]
    assert row["predicted_step_ms"] == pytest.approx(40.0) and row["prediction_error"] == pytest.approx(-0.2)


def test_gradient_clock_records_forward_ready_times_and_comm():
    import torch

    from ddp_lab.rank.profiler import GradientClock
    from ddp_lab.rank.timing import StepTimer

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model[0].bias.requires_grad_(False)  # frozen: not in the clock's table
    clock = GradientClock(model)
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    model(torch.randn(3, 4)).sum().backward()
    timer.lap("fwd_bwd_ms")
    timer.stop_ms()
    clock.end_step(5, False, timer, [(timer.started + 0.001, timer.started + 0.002)])
    (step,) = clock.steps
    assert [p["name"] for p in clock.params] == ["0.weight", "2.weight", "2.bias"]
    assert clock.params[0]["bytes"] == 4 * 8 * 4
    f0, f1 = step["forward_ms"]
    assert 0 <= f0 <= f1 <= min(step["ready_ms"]) <= max(step["ready_ms"]) <= step["laps_ms"]["fwd_bwd_ms"]
    assert step["ready_ms"][0] >= step["ready_ms"][1]  # the first layer's gradient is ready last
    assert step["comm_ms"] == [[pytest.approx(1.0), pytest.approx(2.0)]]
    assert step["end_ms"] >= step["laps_ms"]["fwd_bwd_ms"]


def test_slowdowns_carry_the_fitted_pair_to_other_world_sizes():
    from ddp_lab.analysis.predict.costs import slowdowns

    fitted = {"u": 0.3, "compute_slowdown": 1.3, "comm_slowdown": 2.0}
    assert slowdowns(fitted, 2, 2, 2, 1) == (pytest.approx(1.3), pytest.approx(2.0))
    # 4 ranks on 2 cores, u = 0.3: compute 0.5 alone, 2 / (4 * 1.3) with comm: x1.3; comm 1 alone: x2.6 (x2 of 1.3)
    assert slowdowns(fitted, 4, 2, 2, 1) == (pytest.approx(1.3), pytest.approx(4.0))


def test_local_sgd_and_uncompressed_powersgd():
    # sync every 4: the median step has no communication; every step: one 2 MB all-reduce (3 ms) after the update
    assert job_step(_model(), _cfg("local_sgd", sync_every=4))[1].step_ms == pytest.approx(36.0)
    assert job_step(_model(), _cfg("local_sgd", sync_every=1))[1].step_ms == pytest.approx(39.0)
    early = {**_cfg("powersgd", bucket_mb=25, start_iter=10),
             "train": {"batch_size": 8, "steps": 12, "warmup_steps": 3}}
    assert job_step(_model(), early)[1].step_ms == pytest.approx(39.0)  # as bucketed: 7 of 9 steps uncompressed
    late = {**early, "strategy": {**early["strategy"], "start_iter": 0}}
    with pytest.raises(PredictError, match="compressed"):  # a profile without shapes
        job_step(_model(), late)


def test_compressed_powersgd_hand_computed():
    # two 500 x 500 gradients (1 MB), one bucket each at 1 MiB: b's (ready at 10), then a's (at 20).
    # rank 1: P and Q are 500 numbers (2 kB: 1.002 ms); phase k's work k ms a matrix.
    model = _model()
    for p in model["compute"]["params"]:
        p["shape"] = [500, 500]
    model["host"]["powersgd"] = {"phase_ms": [2.0, 4.0, 6.0], "numel": 500000}
    cfg = _cfg("powersgd", bucket_mb=1, start_iter=0, rank=1)
    # backward: b's phase 1 (10-11), P_b 11-12.002; a's phase 1 (21-22), P_a 22-23.002; b's phase 2 (22-24,
    # P_b long done), Q_b 24-25.002: 24 of work. Then a's phase 2 (25.002-27.002), Q_a (-28.004), both
    # phase 3s (6 ms): 34.004; 2.004 of it exposed (the phases' 8 ms are compute, `compress_ms`, as the
    # strategy counts them); + forward 10, optimizer 5, rest 1
    step, r = job_step(model, cfg)
    assert step.backward_ms == pytest.approx(24.0)
    assert [c.label for c in step.collectives] == ["P 1-1", "P 0-0", "Q", "phase 2 work", "Q", "phase 3 work"]
    assert (r.exposed_ms, r.step_ms) == (pytest.approx(2.004), pytest.approx(50.004))
    # a slow P_b makes a's hook wait for it before b's phase 2: 11 + 20 ms, done at 31 of wall, 9 after
    model["collectives"]["gloo"]["all_reduce"]["fp32"]["by_world_size"]["2"] = {"alpha_ms": 20.0, "beta_GBps": 1.0}
    assert job_step(model, cfg)[1].stalled_ms == pytest.approx(31.002 - 22)


def test_heldout_scores_each_group_with_its_own_model(tmp_path, capsys):
    """OUT/model.json scores OUT/heldout/*; OUT/link/R/model.json scores OUT/link/R/train (a slower link's
    collectives: the same jobs predicted slower), each group's mean and worst error in one table."""
    from ddp_lab.analysis.predict import heldout
    from tests.helpers.report_fixtures import train_results

    def jobs(folder):
        for i, strategy in enumerate(("naive", "flat")):
            res = train_results(strategy, step_ms=50.0, exposed_ms=5.0)
            res["config"]["train"], res["config"]["model"]["context_length"] = {"batch_size": 8}, 64
            write_job(folder / str(i), res)

    (tmp_path / "model.json").write_text(json.dumps({**_model(), "version": fitting.VERSION}))
    jobs(tmp_path / "heldout" / "strategies")
    slow = {**_model(), "version": fitting.VERSION}
    slow["collectives"]["gloo"]["all_reduce"]["fp32"]["by_world_size"]["2"] = {"alpha_ms": 1.0, "beta_GBps": 0.1}
    (tmp_path / "link" / "1").mkdir(parents=True)
    (tmp_path / "link" / "1" / "model.json").write_text(json.dumps(slow))
    jobs(tmp_path / "link" / "1" / "train")
    groups = heldout.run(tmp_path)
    assert [g["group"] for g in groups] == ["strategies", "link 1 Gbit/s"]
    here, link = groups
    assert here["jobs"] == link["jobs"] == 2
    by = {r["strategy"]: r for r in here["rows"]}
    assert by["naive"]["predicted_step_ms"] == pytest.approx(40.0)  # as in the replay test above
    assert {r["strategy"]: r["predicted_step_ms"] for r in link["rows"]}["naive"] > 40.0
    assert here["step"] == pytest.approx((abs(by["naive"]["error"]) + abs(by["flat"]["error"])) / 2)
    assert main(["heldout", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| strategies: other strategies at 2 ranks" in out and "| link 1 Gbit/s: emulated nodes at 1 Gbit/s" in out
    assert main(["heldout", str(tmp_path / "nothing")]) == 2


# --- measured compute -------------------------------------------------------------------------------

def _tiny_row(batch: int, fwd_bwd: float | None = 30.0, **over) -> dict:
    cfg = load_model("tiny")
    row = {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "date": "2026-11-27", "model": "tiny",
           "context": cfg.context_length, "params": sum(p["numel"] for p in scaling.parameters(cfg)), "batch": batch,
           "precision": "bf16", "compile": False, "step_ms": (fwd_bwd or 30.0) + 2.0}
    if fwd_bwd is not None:
        row.update({FWD_BWD.key: fwd_bwd, OPTIMIZER.key: 2.0})
    return {**row, **over}


def test_scale_takes_compute_from_a_measured_row_and_assumes_only_where_none_matches():
    h200, cfg = SYSTEMS["h200"], load_model("tiny")
    table = [_tiny_row(4, 30.0), _tiny_row(8, 50.0)]
    at = {b: scaling.workload(h200, cfg, b, table) for b in (2, 4, 6, 8, 16)}
    assert at[4].compute.kind == "measured" and at[4].forward_ms + at[4].backward_ms == pytest.approx(30.0)
    assert at[4].optimizer_ms == 2.0 and at[4].forward_ms == pytest.approx(10.0)  # split by FLOPs: a third
    assert step_ms(h200, at[4], 1, "bucketed")["step_ms"] == pytest.approx(32.0)  # one GPU: the measured step
    assert at[6].compute.kind == "interpolated" and at[6].backward_ms * 1.5 == pytest.approx(40.0)
    assert at[16].compute.kind == "scaled" and at[16].backward_ms * 1.5 == pytest.approx(100.0)
    assert at[2].compute.kind == "scaled" and at[2].backward_ms * 1.5 == pytest.approx(15.0)
    assert "compute measured" in at[4].compute.line and "guess" in at[16].compute.line
    # no row of this GPU, this compile, this context, this precision or this model: the assumption, as before
    assumed = scaling.workload(SYSTEMS["h100-nvlink"], cfg, 4, table)
    for w in (assumed, scaling.workload(h200, cfg, 4, table, compiled=True),
              scaling.workload(h200, cfg, 4, [_tiny_row(4, context=cfg.context_length * 2)]),
              scaling.workload(h200, cfg, 4, [_tiny_row(4, precision="fp32")]),
              scaling.workload(h200, cfg, 4, [_tiny_row(4, model="small")])):
        assert w.compute.kind == "assumed" and "MFU 0.5" in w.compute.line
    rate = 989.4e12 * 0.5
    assert assumed.backward_ms == pytest.approx(flops_per_token(cfg)["backward"] * 4 * cfg.context_length / rate * 1e3)
    # a whole step measured: the optimizer priced and taken out of it
    whole = scaling.workload(h200, cfg, 4, [_tiny_row(4, None)])
    assert whole.forward_ms + whole.backward_ms + whole.optimizer_ms == pytest.approx(32.0)
    assert whole.optimizer_ms == pytest.approx(28 * _tiny_row(4)["params"] / 4.8e12 * 1e3)


def test_the_lab_table_prices_xl_on_the_h200_and_says_so(capsys):
    assert main(["scale", "--system", "h200", "--model", "xl", "--batch", "32", "--world-size", "1",
                 "--strategy", "bucketed"]) == 0
    out = capsys.readouterr().out
    assert "Compute measured: xl at batch 32, bf16, eager, on NVIDIA H200" in out and "MFU 0.26" in out
    assert "| bucketed | 1 | 206.0 |" in out  # the measured step, given back at one GPU
    assert main(["scale", "--system", "h200", "--model", "xl", "--compile", "--world-size", "1",
                 "--strategy", "bucketed"]) == 0
    assert "Compute assumed: the GPU's peak x MFU 0.5" in capsys.readouterr().out


def test_record_keeps_only_gpu_floor_jobs(tmp_path, capsys):
    def floor(device: str, strategy: str = "none", world_size: int = 1) -> dict:
        res = train_results(strategy, step_ms=36.0, exposed_ms=0.0, world_size=world_size,
                            memory={"num_params": _tiny_row(4)["params"]})
        res["config"].update(model={"name": "tiny", "context_length": 64},
                             train={"batch_size": 4, "precision": "bf16", "compile": False})
        res["env"].update(torch="2.13.0+cu130", devices=[f"host:{device}"] * world_size)
        return res

    for name, res in (("gpu", floor("NVIDIA H200")), ("cpu", floor("cpu")), ("synced", floor("NVIDIA H200", "flat")),
                      ("two", floor("NVIDIA H200", world_size=2))):
        write_job(tmp_path / "sweep" / name, res)
    table = tmp_path / "table.json"
    assert main(["record", str(tmp_path / "sweep"), "--table", str(table)]) == 0
    rows = json.loads(table.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["device"] == "NVIDIA H200" and rows[0][FWD_BWD.key] == 34.0
    assert main(["record", str(tmp_path / "sweep"), "--table", str(table)]) == 0  # again: replaced, not added
    assert len(json.loads(table.read_text())["rows"]) == 1 and "0 rows added, 1 replaced" in capsys.readouterr().out
    assert main(["scale", "--system", "h200", "--model", "tiny", "--world-size", "1", "--compute-table", str(table),
                 "--strategy", "bucketed"]) == 0
    assert "| bucketed | 1 | 36.0 |" in capsys.readouterr().out
    assert main(["record", str(tmp_path / "sweep" / "cpu"), "--table", str(table)]) == 2
    assert "no finished floor job" in capsys.readouterr().err


def test_scale_prices_tensor_parallelism_as_a_split_step_plus_its_blocking_collectives():
    """`scale --tp`: the strategy on N/tp ranks over 1/tp of the model (its compute and optimizer too), and TP's
    collectives (spec/parallel.py's schedule, bf16 activations, over tp ranks) added whole; tp=1 is the plain row."""
    system, model = SYSTEMS["h100-nvlink"], load_model("large")
    work = scaling.workload(system, model, 8, table=[])
    plain = step_ms(system, work, 16, "bucketed", 8)
    assert step_ms(system, work, 16, "bucketed", 8, tp=1) == plain and plain["tp_ms"] == 0.0
    split = step_ms(system, work, 16, "bucketed", 8, tp=4)
    dp_part = step_ms(system, scaling.split_workload(work, 4), 4, "bucketed", 8)
    assert split["tp_ms"] > 0 and split["step_ms"] == pytest.approx(dp_part["step_ms"] + split["tp_ms"])
    assert split["compute_ms"] == pytest.approx(plain["compute_ms"] / 4)
    assert scaling.tp_ms(system, model, 4, 16) > scaling.tp_ms(system, model, 4, 8)  # activations grow with tokens
    with pytest.raises(PredictError, match="does not divide"):
        step_ms(system, work, 6, "bucketed", 8, tp=4)
    with pytest.raises(PredictError, match="model.num_heads must divide"):
        scaling.tp_ms(system, model, 3, 8)


def test_scale_prices_context_parallelism_as_a_split_step_plus_what_attention_cannot_hide():
    """`scale --cp`: a shard's sequences split over cp GPUs by tokens (1/cp of the compute, every parameter, the
    strategy over dp x cp ranks), the zigzag ring's exchange priced as the collectives that move its bytes, and only
    what outlasts the blocks' attention added to the step; cp=1 is the plain row. The exchange grows with the
    context, the attention that hides it faster (quadratic)."""
    system, model = SYSTEMS["h100-nvlink"], load_model("large", 4096)
    work = scaling.workload(system, model, 1, table=[])
    plain = step_ms(system, work, 16, "bucketed", 1)
    assert step_ms(system, work, 16, "bucketed", 1, cp=1) == plain and plain["cp_ms"] == 0.0
    split = step_ms(system, work, 16, "bucketed", 1, cp=4)
    dp_part = step_ms(system, scaling.split_context(work, 4), 16, "bucketed", 1)
    assert split["compute_ms"] == pytest.approx(plain["compute_ms"] / 4)
    assert split["cp_ms"] > 0 and 0 <= split["cp_unhidden_ms"] <= split["cp_ms"]
    assert split["step_ms"] == pytest.approx(dp_part["step_ms"] + split["cp_unhidden_ms"])
    long = scaling.workload(system, load_model("large", 32768), 1, table=[])
    longer = step_ms(system, long, 16, "bucketed", 1, cp=4)
    assert longer["cp_ms"] > split["cp_ms"] and longer["cp_unhidden_ms"] == 0.0
    with pytest.raises(PredictError, match="does not divide"):
        step_ms(system, work, 6, "bucketed", 1, cp=4)
    with pytest.raises(PredictError, match="does not divide by 8"):
        step_ms(system, scaling.workload(system, load_model("large", 4092), 1, table=[]), 16, "bucketed", 1, cp=4)
