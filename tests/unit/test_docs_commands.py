"""Every `python launch.py ...` line of the README and the docs passes launch.py's own pre-launch checks (Hydra's
composition of every job, every check) without starting a job, as `python launch.py ... --dry-run` does; a line
whose comment says it is refused must be refused. A renamed or removed key fails here, naming the page and line.
`python -m ddp_lab.calculator`, `python -m ddp_lab.spec` and `python -m ddp_lab.plan` lines of fenced blocks run whole
(arithmetic).

Placeholders a reader replaces are substituted (a text or token file of the test's own for `data.path`), or left
out where they name what an earlier command writes (`checkpoint.load=JOB`, `resume=SWEEP`, an output folder:
LATER); a line that needs what this machine cannot give is answered by the check with that reason and passes only
with it (ELSEWHERE: a GPU for NCCL, root for network namespaces, an extra not installed). Every line runs; none
is sampled.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ddp_lab.config import register_configs
from ddp_lab.launcher.preflight import check_command_line, knobs_of_swept_groups

ROOT = Path(__file__).resolve().parents[2]
register_configs()  # as launch.py does on import: the schema Hydra composes on
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LAUNCH = "python launch.py"
MODULES = ("python -m ddp_lab.calculator", "python -m ddp_lab.spec", "python -m ddp_lab.plan")
REFUSED = re.compile(r"#.*\brefused\b")
ELSEWHERE = ("nccl", "GPU", "root", "iproute2", "pip install", "not installed", "DeepSpeed", "torchft")
"""What a refusal may name when the line needs another machine or an extra (the docs say which)."""
LATER = re.compile(r"^(checkpoint\.load|resume|hydra\.run\.dir|hydra\.sweep\.dir)=")
"""Words naming a folder an earlier command writes (a job to load, a sweep to resume) or the output folder: left
out (the test adds its own output folder); the rest of the line is checked."""


def _lines(page: Path):
    """(line number, command) of every command line of a page: each line of a fenced block that starts one
    (continuations joined, a shell variable the block set expanded, a pipe's tail cut), and each inline
    `python launch.py ...` span that is a whole command (no `...`, `KEY=` or `=N` standing for the rest)."""
    fenced, held, start, shell = False, "", 0, {}
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced, held, shell = not fenced, "", {}
            continue
        if fenced:
            start = start if held else number
            if line.rstrip().endswith("\\"):
                held += line.rstrip()[:-1].rstrip() + " "
                continue
            text, held = re.sub(r"^\$ ", "", (held + line).strip()), ""
            assigned = re.match(r"(\w+)=\"([^\"]*)\"$", text)
            if assigned:
                shell[assigned.group(1)] = assigned.group(2)
            if text.startswith((LAUNCH, *MODULES)):
                for name, value in shell.items():
                    text = text.replace(f"${name}", value)
                yield start, text.split(" | ")[0]
        else:
            for found in re.findall(rf"`({re.escape(LAUNCH)}[^`]*)`", line):
                if not any(mark in found for mark in ("...", "KEY=", "=N")):
                    yield number, found


CASES = [pytest.param(text, id=f"{page.relative_to(ROOT)}:{number}") for page in PAGES
         for number, text in _lines(page)]


def _data_files(tmp: Path) -> dict[str, Path]:
    """A text file and a token file standing for the reader's own (`data.path=my_corpus.txt`, `train.bin`)."""
    text, tokens = tmp / "corpus.txt", tmp / "train.bin"
    if not tokens.exists():
        text.write_text("The quick brown fox jumps over the lazy dog. " * 400)
        np.arange(4096, dtype=np.uint16).tofile(tokens)
    return {"text": text, "tokens": tokens}


def _words(text: str, tmp: Path) -> tuple[list[str], bool]:
    """The command's words after `python launch.py` (or `python -m`), the reader's files standing in, and
    whether its comment says it is refused."""
    refused = bool(REFUSED.search(text))
    words = shlex.split(re.split(r"\s+#", text, maxsplit=1)[0])
    files = _data_files(tmp)
    kind = "text" if "data=text" in words else "tokens"
    out = []
    for word in words:
        key, _, value = word.partition("=")
        if key in ("data.path", "data.val_path") and not (ROOT / value).exists():
            word = f"{key}={files[kind]}"
        if not LATER.match(word) and word != "--dry-run":
            out.append(word)
    return out, refused


def test_the_docs_have_command_lines_to_prove():
    assert sum(1 for c in CASES if c.values[0].startswith(LAUNCH)) >= 50


@pytest.mark.parametrize("text", CASES)
def test_every_documented_command_line_passes_the_checks(text, tmp_path_factory, capsys):
    tmp = tmp_path_factory.getbasetemp()
    words, refused = _words(text, tmp)
    if words[:2] == ["python", "-m"]:
        module = __import__(words[2] + (".__main__" if words[2] == "ddp_lab.spec" else ""), fromlist=["main"])
        with contextlib.redirect_stdout(io.StringIO()):
            assert module.main(words[3:]) == 0, text
        return
    out = tmp / "docs_run"
    args = knobs_of_swept_groups([*words[2:], f"hydra.run.dir={out}", f"hydra.sweep.dir={out}"])
    code = 0
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            check_command_line(ROOT / "conf", "config", args)
        except SystemExit as exc:
            code = exc.code
    err = capsys.readouterr().err
    if refused:
        assert code == 2, f"documented as refused, accepted: {text}"
    elif code:
        assert any(reason in err for reason in ELSEWHERE), f"{text}\n{err}"
    assert not out.exists()


def test_dry_run_checks_every_job_and_starts_none(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "strategy=naive,flat", "-m", "--dry-run",
                           f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0 and "none started" in proc.stdout, proc.stderr
    assert not (tmp_path / "sweep").exists()
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "strategy.bucket_mbb=1", "--dry-run"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr
