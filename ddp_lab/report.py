"""`python -m ddp_lab.report`: the command; its code is ddp_lab/analysis/report.py."""

import sys

from ddp_lab.analysis.report import main

if __name__ == "__main__":
    sys.exit(main())
