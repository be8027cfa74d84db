"""The check's reading of what ranks left (ddp_lab/check/: verdict.py, observe.py, parity.py, the command's
arguments), on fabricated results: no rank runs."""

import pytest
import torch
from torch import nn

from ddp_lab.check.__main__ import _constructor_args
from ddp_lab.check.cases import CASES
from ddp_lab.check.observe import describe
from ddp_lab.check.parity import _whole
from ddp_lab.check.verdict import crash_line, verdict

TRACEBACK = '''Traceback (most recent call last):
  File "/usr/lib/python3.11/multiprocessing/process.py", line 314, in _bootstrap
    self.run()
  File "/work/main/ddp_lab/check/ranks.py", line 52, in _entry
    result = fn(rank, world_size, *args)
  File "/home/student/a2/cs336_systems/ddp.py", line 41, in _hook
    self.buckets[i].view(-1)
  File "/work/venv/lib/python3.11/site-packages/torch/_tensor.py", line 10, in view
    raise AttributeError("x")
AttributeError: 'NoneType' object has no attribute 'view'
'''


def test_a_crash_reads_as_the_exception_at_the_users_frame():
    import torch as t

    text = TRACEBACK.replace("/work/venv/lib/python3.11/site-packages/torch", str(t.__path__[0]))
    assert crash_line(text) == ("AttributeError: 'NoneType' object has no attribute 'view' "
                                "(/home/student/a2/cs336_systems/ddp.py:41, in _hook)")
    assert crash_line("ValueError: no frames") == "ValueError: no frames"


def _result(start: dict, trained: dict, reference: dict | None) -> tuple:
    return start, trained, reference, {}


def test_the_cause_is_read_from_which_parameters_differ_and_where():
    case = CASES["tied"]  # TiedNet: embed.weight and out.weight are one weight
    w = {"embed.weight": torch.zeros(2), "out.weight": torch.zeros(2), "hidden.weight": torch.zeros(2)}
    moved = {**w, "hidden.weight": torch.ones(2)}
    assert verdict(case, [_result(w, w, w), _result(w, w, None)], 1e-5, 1e-4) is None
    assert verdict(case, [_result(w, w, w), _result(moved, w, None)], 1e-5, 1e-4).startswith(
        "the start-up broadcast: rank 1 began from its own weights (hidden.weight differ")
    untied = {**w, "out.weight": torch.ones(2)}
    assert verdict(case, [_result(w, untied, w), _result(w, w, None)], 1e-5, 1e-4).startswith(
        "the tie is broken on rank 0: embed.weight and out.weight are one weight")
    assert verdict(case, [_result(w, moved, w), _result(w, w, None)], 1e-5, 1e-4).startswith(
        "the ranks disagree after training (hidden.weight)")
    assert verdict(case, [_result(w, moved, w), _result(w, moved, None)], 1e-5, 1e-4).startswith(
        "every rank agrees, and all differ from one process")
    frozen = {"frozen.weight": torch.zeros(2)}
    assert verdict(CASES["frozen"], [_result(frozen, {"frozen.weight": torch.ones(2)}, frozen)], 1e-5, 1e-4) \
        .startswith("a frozen parameter moved (frozen.weight)")


def test_weights_that_are_not_whole_are_refused_naming_what_to_offer():
    model = nn.Linear(4, 2)
    assert _whole(model.state_dict(), model) is not None
    with pytest.raises(ValueError, match=r"weight: shape \(4,\), expected \(2, 4\)\): give it full_state_dict\(\) or "
                                         r"gather_full_params\(\)"):
        _whole({"weight": torch.zeros(4), "bias": torch.zeros(2)}, model)


def test_set_values_naming_a_dtype_are_that_dtype():
    assert _constructor_args(["compute_dtype=bfloat16", "dtype=torch.float16", "bucket_mb=25", "name=fp16"]) == \
        {"compute_dtype": torch.bfloat16, "dtype": torch.float16, "bucket_mb": 25, "name": "fp16"}


def test_what_was_seen_reads_in_a_line():
    def rank(params, optimizer, sharded=(), whole=()):
        held = {"params_pct": params, "optimizer_pct": optimizer, "sharded": list(sharded), "whole": list(whole)}
        return (None, None, None, {"calls": {"all_reduce": 8, "broadcast": 4}, "in_backward": 8, "held": held,
                                   "sizes": [2**20] * 8 + [2**10] * 4})

    per_rank = [rank(50.0, 50.4, ["Linear"], ["RMSNorm"]), rank(52.0, 51.0, ["Embedding", "Linear"], ["RMSNorm"])]
    assert describe(per_rank, 4) == ("per step 3 collectives (all_reduce 2, broadcast 1, 2.00 MiB per step, the "
                                     "largest 1.00 MiB), 2 of them issued during backward, 2 launched "
                                     "asynchronously with gradients still to come (those can overlap it); the "
                                     "largest rank holds 52% of the parameters, 51% of AdamW's state; sharded "
                                     "Embedding, Linear, whole RMSNorm")
    quiet = [(None, None, None, {"calls": {}, "in_backward": 0,
                                 "held": {"params_pct": 100.0, "optimizer_pct": None, "sharded": [], "whole": []}})]
    assert describe(quiet, 4) == "no collective seen; the largest rank holds 100% of the parameters"


def test_a_dict_key_is_named_without_calling_the_users_repr():
    """A module key by its class and its path in the wrapper, another object by its class and id, plain values by
    their repr; nothing of the user's runs (a repr that raises is never called)."""
    import torch

    from ddp_lab.check.observe import key_text, reachable

    class Loud(torch.nn.Linear):
        def extra_repr(self):
            raise AttributeError("'Loud' object has no attribute 'weight'")

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = Loud(2, 2)
            self.by_layer = {self.layer: torch.zeros(3), "name": torch.zeros(1), (1, "a"): torch.zeros(1)}

    wrapper = Wrapper()
    where = [w for w, _ in reachable(wrapper)]
    assert "self.by_layer[<Loud self.layer>]" in where and "self.by_layer['name']" in where
    assert "self.by_layer[(1, 'a')]" in where
    assert key_text(object(), {}).startswith("<object at 0x")


def test_an_observation_that_raises_is_unmeasured_never_a_verdict():
    """What the check cannot walk (a user's object whose attributes raise when read) is said as unmeasured, in the
    seen line and as the sharded claim's skip reason, never as the case's failure."""
    import torch

    from ddp_lab.check.cases import held_or_unmeasured
    from ddp_lab.check.observe import describe
    from ddp_lab.check.properties import unjudged

    class Hostile:
        @property
        def __dict__(self):
            raise RuntimeError("no peeking")

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(2, 2)
            self.secret = Hostile()

    Hostile.__module__ = "my_pkg.fsdp"  # a user's class, which the walk enters
    wrapper = Wrapper()
    held = held_or_unmeasured(wrapper, torch.optim.SGD(wrapper.parameters(), lr=0.1),
                              {"module": wrapper.module, "layers": {}})
    assert held == {"unmeasured": "RuntimeError: no peeking"}
    seen = {"calls": {}, "in_backward": 0, "sizes": [], "held": held}
    assert "what each rank holds could not be measured (the check's own limit, no verdict on the code: " \
           "RuntimeError: no peeking)" in describe([(None, None, None, seen)], 4)
    assert "could not be measured" in unjudged({"plain": [(None, None, None, seen)]}, "sharded")
    assert unjudged({"plain": [(None, None, None, seen)]}, "overlap") is None


def test_a_compute_dtypes_tolerance_is_twice_its_rounding_spread_with_a_floor():
    from ddp_lab.check.verdict import Tolerance, atol_of

    tolerance = Tolerance({"w": 0.004, "b": 1e-6}, 1e-3, "float16")
    assert atol_of(tolerance, "w") == 0.008 and atol_of(tolerance, "b") == 1e-3 and atol_of(tolerance, "new") == 1e-3
    assert atol_of(1e-5, "w") == 1e-5
    assert tolerance.describe("w").startswith("tolerance 0.008: twice how far one rounding")


def test_the_rounding_reference_moves_each_gradient_by_one_rounding_at_most():
    """parity.CastSingleProcess(jitter=seed): each low-precision gradient, widened, moved by the dtype's unit roundoff
    times its magnitude, with a random sign per element (both signs drawn)."""
    import torch
    from torch import nn

    from ddp_lab.check.parity import CastSingleProcess

    grads = {}
    for jitter in (None, 3):
        torch.manual_seed(0)
        model = nn.Linear(64, 64)
        wrapper = CastSingleProcess(model, torch.float16, jitter=jitter)
        wrapper(torch.randn(8, 64).half()).square().sum().backward()
        wrapper.finish_gradient_synchronization()
        grads[jitter] = model.weight.grad.clone()
    moved = (grads[3] - grads[None]) / grads[None].abs().clamp_min(1e-30)
    unit = torch.finfo(torch.float16).eps / 2
    assert moved.abs().max() <= unit * 1.0001 and (moved > 0).any() and (moved < 0).any()


def test_a_rank_killed_mid_write_leaves_no_error_file(tmp_path, monkeypatch):
    """A rank writes its error whole or not at all (ranks.py, with jobdir's `write_text_atomic`): killed before the
    rename (torch's spawn context kills the others once one rank has raised), it leaves no `rank{R}.err`, which
    run_ranks would have read as that rank's error, empty ("rank 0 raised an exception" where rank 1's said why: seen
    once in CI)."""
    import os

    from ddp_lab.check import ranks

    ranks.write_text_atomic(tmp_path / "rank1.err", "Traceback ...\nRuntimeError: Unable to find address for: nope\n")
    assert (tmp_path / "rank1.err").read_text().endswith("for: nope\n")

    def killed(*args):
        raise KeyboardInterrupt  # what a signal arriving between the write and the rename would raise

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        ranks.write_text_atomic(tmp_path / "rank0.err", "Traceback ...")
    assert sorted(os.listdir(tmp_path)) == ["rank1.err"]
