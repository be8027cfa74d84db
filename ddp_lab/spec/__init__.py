"""The description layer: facts and arithmetic every process shares, with no torch and no process group.

The launcher, the ranks (rank/, strategies/, tasks/) and the offline tools (analysis/) all import
from here, and nothing here imports any of them, so each fact has one home that every process can
read without loading another process's code:

| module | what it holds |
|---|---|
| buckets.py | the bucket plan by sizes (`plan_bucket_indices`) and the default bucket size |
| zero_bytes.py | bytes per rank under the ZeRO stages, bytes on the link per step |
| bandwidth.py | nccl-tests' algbw / busbw arithmetic, bytes a collective moves per rank |
| intervals.py | union, intersection and difference of time intervals (exposed comm, overlap) |
| stats.py | the summary (mean, p50, p90, ...) every table and W&B summary shares |
| labels.py | run names and table row labels, from a config alone |
"""
