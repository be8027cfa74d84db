import os

# No test talks to W&B's servers; offline runs are written where a test asks for them.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
