"""Predict a training step before running it: a model calibrated on this machine, checked against
measurement, and carried to named GPU systems (`python -m ddp_lab.predict`, docs/predict.md).

- fit.py: alpha-beta collectives from a collective sweep; compute, gradient-ready times and core
  sharing from one profiled run (JOB/phases.json); the model file.
- costs.py: one collective's time from its fit, the core share, tokens per rank.
- replay.py: one step replayed event by event (compute, collectives queued as gradients are ready,
  exposed remainder, optimizer).
- schedule.py: which collectives each strategy issues, as a step to replay.
- validate.py: predicted against measured, job by job, and the best bucket size.
- systems.py, scale.py: named GPU systems with cited figures, and the step at any world size.
- cli.py: the command.
"""
