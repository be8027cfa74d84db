"""Imported once by the fork server that `run_ranks` forks every rank from (ranks.PRELOAD), never elsewhere.

It imports what every rank needs, so a rank starts with it instead of importing it again: torch,
torch.distributed, and torch._dynamo, which every optimizer imports on first use (`torch._disable_dynamo`
on `Optimizer.add_param_group`: 2.5 s a process on this project's 2-core machine). Then it freezes the
heap (`gc.freeze`, what the gc docs advise before forking): the ranks' garbage collections skip those
283,000 objects instead of walking them, 0.3 s a `gc.collect()`, and `rank/memory.py`'s census, which
lists what the collector tracks, sees only tensors made after the fork (a tensor made at import time is
the same in every census, so nothing it compares changes).
"""

import gc

import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401

import ddp_lab.check.ranks  # noqa: F401  (the ranks' entry point)

gc.freeze()
