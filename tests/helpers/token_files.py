"""Token files written as nanoGPT, llm.c / modded-nanogpt and numpy write them, for the data tests."""

from pathlib import Path

import numpy as np

LLMC_UINT16 = (20240520, 1)   # GPT-2 tokens
LLMC_UINT32 = (20240801, 7)   # llama 3 tokens


def counting_tokens(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    """Learnable ids: runs counting up from random starts (a model's loss falls on them)."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, vocab, size=n // 16 + 1)
    return ((starts[:, None] + np.arange(16)) % vocab).reshape(-1)[:n]


def write_raw(path: Path, tokens, dtype=np.uint16) -> Path:
    """nanoGPT's train.bin (and CS336's np.memmap): the ids, no header."""
    np.asarray(tokens, dtype=dtype).tofile(path)
    return path


def write_llmc(path: Path, tokens, magic_version=LLMC_UINT16, count: int | None = None) -> Path:
    """An llm.c shard: 256 int32 (magic, version, token count, zeros), then the ids."""
    magic, version = magic_version
    dtype = np.uint16 if version == 1 else np.uint32
    header = np.zeros(256, dtype=np.int32)
    header[:3] = magic, version, len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=dtype).tobytes())
    return path
