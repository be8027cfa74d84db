"""`python -m ddp_lab.report`: the command; its code is ddp_lab/analysis/report.py."""

import sys

from ddp_lab.analysis.report import main
from ddp_lab.piped import exit_code

if __name__ == "__main__":
    sys.exit(exit_code(main))
