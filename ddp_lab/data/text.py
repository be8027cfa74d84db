"""The built-in text: English prose that ships with every Python, nothing to download.

The standard library's `pydoc_data.topics` holds the reference manual's topics that `help()` shows
(about 466 KB of prose with some code in it, on CPython 3.12). It is joined in the order of its
topic names into one UTF-8 file under the cache folder, written once per Python version (the
topics change between versions) and atomically (ranks or jobs that start together never read half a
file); a rank memory-maps it as bytes. Tokens are its bytes (vocab 256), so no tokenizer is trained
or installed and a token means the same on every machine.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from ddp_lab.data.files import DataError

BYTE_VOCAB = 256


def cache_dir() -> Path:
    """$DDP_LAB_CACHE, else $XDG_CACHE_HOME/ddp-lab, else ~/.cache/ddp-lab."""
    if os.environ.get("DDP_LAB_CACHE"):
        return Path(os.environ["DDP_LAB_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddp-lab"


def python_docs() -> Path:
    """The built-in corpus's file, written on first use."""
    path = cache_dir() / f"python{sys.version_info.major}.{sys.version_info.minor}-docs.txt"
    if path.exists():
        return path
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise DataError("data=text: this Python has no pydoc_data (the standard library's help() topics): "
                        "point data.path at a UTF-8 text file") from None
    text = "\n\n".join(topics[name].strip() for name in sorted(topics))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
        os.replace(tmp, path)
    except OSError as exc:
        raise DataError(f"data=text: cannot write the built-in corpus to {path.parent}: {exc.strerror or exc} "
                        "(set DDP_LAB_CACHE to a writable folder)") from None
    return path


def check_utf8(path: Path, probe_bytes: int = 1 << 20) -> None:
    """The file's first MiB decodes as UTF-8 (a binary token file given to data=text would train on noise)."""
    with open(path, "rb") as f:
        head = f.read(probe_bytes)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 3:  # not just a character cut at the end of the probe
            raise DataError(f"{path}: not UTF-8 text (byte {exc.start}): data=text reads a text file; token "
                            "files are data=tokens") from None
