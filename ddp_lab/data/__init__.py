"""What the ranks train on, read by the launcher (to refuse a bad file before any rank starts) and by every
rank (to build its slice of each batch): token files memory-mapped in the formats people write them
(files.py), the prose that ships with Python (text.py), and the train/validation split with the windows
each step samples from it (split.py). numpy only: no torch, no process group."""

from ddp_lab.data.files import DataError

__all__ = ["DataError"]
