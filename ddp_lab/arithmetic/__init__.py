"""The arithmetic every process shares, with no torch and no process group: the launcher, the ranks
(rank/, strategies/, tasks/) and the offline tools (analysis/) all compute these the same way.

| module | what it computes |
|---|---|
| buckets.py | the bucket plan by sizes (`plan_bucket_indices`) and the default bucket size |
| zero_bytes.py | bytes per rank under the ZeRO stages, bytes on the link per step |
| bandwidth.py | nccl-tests' algbw / busbw arithmetic, bytes a collective moves per rank |
| intervals.py | union, intersection and difference of time intervals (exposed comm, overlap) |
| traces.py | a profiler trace's lanes and the overlap of communication with compute |
| stats.py | the summary (mean, p50, p90, ...) every table and W&B summary shares |

It reads spec/'s tables (figures.py: which figure is which; choices.py: the collective ops); spec/'s
strategy specs use its bucket plan and ZeRO bytes. No module imports back into one that imports it.
"""
