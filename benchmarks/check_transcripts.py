"""Re-run every transcript of `python -m ddp_lab.check` in the docs and write its output in place.

A transcript is a fenced block whose first line is `$ python -m ddp_lab.check ...`: the command is run from the
repository's root and the block's other lines become what it printed (the log folder's random name written
`/tmp/ddp_lab_check_XXXX`). Run it after changing the check, on an idle machine, and read the diff: a line that
changed is either the change you meant or one you did not.

    python benchmarks/check_transcripts.py                   # every docs/check*.md
    python benchmarks/check_transcripts.py docs/check_pp.md  # one page
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```\n(\$ python -m ddp_lab\.check [^\n]*)\n(.*?)^```$", re.M | re.S)
LOG_FOLDER = re.compile(r"/tmp/ddp_lab_check_\w+")


def rerun(command: str) -> str:
    """What `command` (a `$ python -m ...` line) prints, its log folder's name made stable."""
    argv = shlex.split(command.removeprefix("$ "))
    argv[0] = sys.executable
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return LOG_FOLDER.sub("/tmp/ddp_lab_check_XXXX", done.stdout + done.stderr).rstrip("\n") + "\n"


def main(pages: list[str]) -> int:
    for page in [Path(p) for p in pages] or sorted((ROOT / "docs").glob("check*.md")):
        text = page.read_text()
        blocks = list(BLOCK.finditer(text))
        for match in reversed(blocks):  # from the end, so earlier offsets stay valid
            print(f"{page.name}: {match.group(1)}", flush=True)
            text = text[:match.start(2)] + rerun(match.group(1)) + text[match.end(2):]
        page.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
