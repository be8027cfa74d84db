"""The description layer: the facts every process shares, with no torch and no process group.

The launcher, the ranks (rank/, strategies/, tasks/) and the offline tools (analysis/) all import
from here, and nothing here imports any of them, so each fact has one home that every process can
read without loading another process's code:

| module | what it holds |
|---|---|
| strategy.py, strategies/ | each strategy's spec: knobs, capabilities, schedule, runtime class; fsdp's unit plan |
| schedule.py | the vocabulary of a strategy's collectives in one step |
| figures.py | every per-step figure: key, unit, how ranks combine it, its summary, its meaning |
| choices.py | the enums config keys take |
| labels.py | run names and table row labels, from a config alone |

The arithmetic every process shares (bucket plan, ZeRO bytes, bandwidth, intervals, traces, the step
summary) is in ddp_lab/arithmetic/.
"""
