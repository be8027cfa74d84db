"""The lab's commands piped into a reader that stops early (`| head`) end quietly, as Unix tools do."""

import subprocess
import sys
from pathlib import Path

import pytest

import ddp_lab

COMMANDS = ["plan", "report", "predict", "timeline", "calculator", "spec/__main__", "check/__main__"]
PACKAGE = Path(ddp_lab.__file__).parent


@pytest.mark.parametrize("command", [
    ["ddp_lab.plan", "--model", "llama3_8b", "--system", "h100-nvlink", "--gpus", "8", "--global-batch", "1M"],
    ["ddp_lab.spec", "--markdown"],
])
def test_a_reader_that_stops_early_gets_no_traceback(command):
    proc = subprocess.Popen([sys.executable, "-m", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    proc.stdout.close()  # the reader is gone before the command has printed anything
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1 and err == ""


def test_every_command_exits_through_the_pipe_guard():
    """`python -m ddp_lab.X` for every command a user types: each wraps its main in exit_code."""
    for name in COMMANDS:
        text = (PACKAGE / f"{name}.py").read_text()
        assert "sys.exit(exit_code(main))" in text and "sys.exit(main())" not in text, name
