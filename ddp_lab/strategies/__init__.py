"""Gradient-synchronization strategies, one file each.

| strategy (`strategy=`) | class | file |
|---|---|---|
| naive | NaiveDDP | naive.py |
| flat | FlatDDP | flat.py |

`Strategy` (strategy.py) is what the YAML instantiates; `DataParallelBase` (base.py) is the shared
wrapper contract.
"""

from ddp_lab.strategies.base import DataParallelBase
from ddp_lab.strategies.flat import FlatDDP
from ddp_lab.strategies.naive import NaiveDDP
from ddp_lab.strategies.strategy import Strategy

__all__ = ["DataParallelBase", "FlatDDP", "NaiveDDP", "Strategy"]
