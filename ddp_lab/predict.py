"""`python -m ddp_lab.predict`: the command; its code is ddp_lab/analysis/predict/cli.py."""

import sys

from ddp_lab.analysis.predict.cli import main
from ddp_lab.piped import exit_code

if __name__ == "__main__":
    sys.exit(exit_code(main))
