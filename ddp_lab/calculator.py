"""`python -m ddp_lab.calculator`: the command; its code is ddp_lab/analysis/calculator.py."""

import sys

from ddp_lab.analysis.calculator import main

if __name__ == "__main__":
    sys.exit(main())
