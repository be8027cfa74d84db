"""`python -m ddp_lab.timeline`: the command; its code is ddp_lab/analysis/timeline.py."""

import sys

from ddp_lab.analysis.timeline import main

if __name__ == "__main__":
    sys.exit(main())
