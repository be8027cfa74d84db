"""What a user's layer holds right after its constructor, before any case trusts it (the tensor-parallel and the
expert-parallel checks build layers from sizes, and such a layer draws or leaves its own weights).

Frameworks that initialize later leave a constructor's weights as `torch.empty` made them and draw them in a
separate `reset_parameters()` (or a model's `init_weights`). Whatever memory held is then the weight: NaN on one run,
zeros or huge numbers on the next, and every case fails with causes about communication that are not the cause.
While the check builds a layer, torch's deterministic mode fills uninitialized memory with NaN
(`torch.utils.deterministic.fill_uninitialized_memory`), so such weights are told apart on every run, and said once.
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

TORCH = str(Path(torch.__file__).parent)


@contextmanager
def unset_memory_as_nan():
    """While the user's layers are built (and, in the expert-parallel check, run): memory torch.empty leaves unset is
    NaN (torch's deterministic mode, put back as it was after). Warn-only, which fills it all the same: an op of the
    user's with no deterministic kernel warns in the rank's log instead of raising."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def unset_weights(layers: dict[str, nn.Module]) -> str | None:
    """The cause when a built layer's parameters are not finite (left unset by its constructor), naming
    `reset_parameters()` where the layer has one; None when every parameter is finite."""
    bad = [f"{name}.{key}" for name, layer in layers.items() for key, p in layer.named_parameters()
           if not torch.isfinite(p.detach()).all()]
    if not bad:
        return None
    resets = sorted({type(layer).__name__ for layer in layers.values()
                     if callable(getattr(layer, "reset_parameters", None))})
    hint = (f"; {' and '.join(resets)} {'has' if len(resets) == 1 else 'have'} reset_parameters(): call it in the "
            "constructor, or draw the weights there") if resets else "; draw them in the constructor"
    return (f"the layers' weights are not finite after they are built ({', '.join(bad)}: memory torch.empty left "
            f"unset, which the check makes NaN so that it shows on every run): no case can train them{hint}")


REFUSALS = (ValueError, AssertionError, NotImplementedError)


def refuses_sizes(exc: BaseException) -> bool:
    """A constructor's error is the layer's own check of its sizes (a case that no degree divides is then a skip)
    when it is a ValueError, AssertionError or NotImplementedError raised in the user's code; anything else (a
    TypeError, torch's error on a slice that does not fit) is a crash the layer did not see coming."""
    if not isinstance(exc, REFUSALS):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and not frames[-1].filename.startswith(TORCH)
