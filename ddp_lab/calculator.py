"""`python -m ddp_lab.calculator`: the command; its code is ddp_lab/analysis/calculator.py."""

import sys

from ddp_lab.analysis.calculator import main
from ddp_lab.piped import exit_code

if __name__ == "__main__":
    sys.exit(exit_code(main))
