"""`python -m ddp_lab.plan`: the command; its code is ddp_lab/analysis/plan/cli.py."""

import sys

from ddp_lab.analysis.plan.cli import main
from ddp_lab.piped import exit_code

if __name__ == "__main__":
    sys.exit(exit_code(main))
