"""Token files as people write them, memory-mapped (a file is never read whole):

- raw: a headerless array of token ids, nanoGPT's `train.bin` (np.uint16) and what CS336's assignments
  write with `np.memmap`; `data.dtype` says uint16 or uint32;
- llm.c: llm.c's and modded-nanogpt's shards, a header of 256 int32 (magic, version, token count) and
  then the tokens: magic 20240520 / version 1 with uint16 tokens (GPT-2), 20240801 / version 7 with
  uint32 tokens (llama 3);
- npy: numpy's `.npy` of a 1-D uint16 or uint32 array.

Byte-level text (text.py) is a raw file of uint8. `format=auto` reads `.npy` by its suffix, a file that
starts with an llm.c magic as llm.c, and anything else as raw. Every problem is a `DataError` whose
message is one line naming the file.
"""

from __future__ import annotations

import glob
from pathlib import Path

import numpy as np

LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = LLMC_HEADER_INTS * 4
LLMC_VERSIONS = {20240520: (1, np.uint16), 20240801: (7, np.uint32)}  # magic: (version, token dtype)
TOKEN_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}
SHARD_SUFFIXES = (".bin", ".npy")


class DataError(ValueError):
    """A data file that cannot be trained on: one line, naming the file and what is wrong."""


def expand(path: str) -> list[Path]:
    """The files `data.path` names: a file, a folder (its .bin and .npy files) or a glob, sorted."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in SHARD_SUFFIXES and f.is_file())
        if not files:
            raise DataError(f"{path}: a folder with no .bin or .npy token files in it")
        return files
    if any(ch in path for ch in "*?["):
        files = sorted(Path(f) for f in glob.glob(str(p)) if Path(f).is_file())
        if not files:
            raise DataError(f"{path}: no file matches")
        return files
    if not p.exists():
        raise DataError(f"{path}: no such file")
    if not p.is_file():
        raise DataError(f"{path}: not a regular file")
    return [p]


def open_tokens(path: Path, fmt: str = "auto", dtype: str = "uint16") -> np.ndarray:
    """The file's tokens as a read-only 1-D memory map."""
    try:
        with open(path, "rb") as f:
            head = f.read(LLMC_HEADER_BYTES)
    except OSError as exc:
        raise DataError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if fmt == "auto":
        magic = int(np.frombuffer(head[:4], dtype="<i4")[0]) if len(head) >= 4 else None
        fmt = "npy" if path.suffix == ".npy" else "llmc" if magic in LLMC_VERSIONS else "raw"
    if fmt == "npy":
        return _open_npy(path)
    if fmt == "llmc":
        return _open_llmc(path, head)
    return _open_raw(path, dtype)


def _open_raw(path: Path, dtype: str) -> np.ndarray:
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"{path}: data.dtype={dtype} is not a token dtype: use uint16 or uint32")
    itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {dtype} tokens")
    if size == 0:
        raise DataError(f"{path}: the file is empty")
    return np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")


def _open_llmc(path: Path, head: bytes) -> np.ndarray:
    if len(head) < LLMC_HEADER_BYTES:
        raise DataError(f"{path}: {len(head)} bytes, shorter than an llm.c header ({LLMC_HEADER_BYTES} bytes)")
    magic, version, count = (int(v) for v in np.frombuffer(head, dtype="<i4")[:3])
    if magic not in LLMC_VERSIONS:
        raise DataError(f"{path}: llm.c magic {magic}, expected 20240520 (uint16 tokens) or 20240801 (uint32)")
    expected_version, dtype = LLMC_VERSIONS[magic]
    if version != expected_version:
        raise DataError(f"{path}: llm.c magic {magic} with version {version}, expected version {expected_version}")
    itemsize = np.dtype(dtype).itemsize
    payload = path.stat().st_size - LLMC_HEADER_BYTES
    if count < 0 or payload != count * itemsize:
        raise DataError(f"{path}: the llm.c header says {count} tokens ({count * itemsize} bytes after the header), "
                        f"the file holds {payload} bytes after it")
    return np.memmap(path, dtype=dtype, mode="r", offset=LLMC_HEADER_BYTES, shape=(count,))


def _open_npy(path: Path) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise DataError(f"{path}: not a readable .npy file: {str(exc).splitlines()[0]}") from None
    if array.dtype not in (np.uint16, np.uint32):
        raise DataError(f"{path}: a .npy of {array.dtype}, expected uint16 or uint32 token ids")
    if array.ndim != 1:
        raise DataError(f"{path}: a .npy of shape {array.shape}, expected one flat array of token ids")
    return array


def max_token(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    """The largest id, read a chunk at a time (16M tokens) so a file of billions of tokens never sits whole
    in memory."""
    return max(int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk))
