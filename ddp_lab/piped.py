"""The lab's commands read as Unix tools do when their reader goes away (`python -m ddp_lab.plan ... | head`).

Python raises BrokenPipeError at the first print after the reader closed the pipe, and again while flushing at exit:
a traceback for nothing the user did wrong. Python's docs ("Note on SIGPIPE", the signal module) give the cure used
here: stdout pointed at /dev/null for the exit's flush, and exit 1.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


def exit_code(main: Callable[[], int | None]) -> int | None:
    """main()'s exit code, or 1 when whoever read its output stopped reading (no traceback)."""
    try:
        code = main()
        sys.stdout.flush()  # inside the try: a broken pipe surfaces here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
