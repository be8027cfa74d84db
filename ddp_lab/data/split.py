"""The train and validation splits of a token stream, and the windows each step samples from them.

A split is a list of token arrays (memory-mapped files, or slices of them). A window is
`context_length + 1` consecutive tokens inside one array (never across two files); a global batch is
`batch_size` windows whose starts are drawn uniformly from every start a split has, from a generator
seeded with (seed, step, split): every rank draws the same starts and reads only its own rows, so the
ranks together see what single-process training on the full batch sees. Validation batches are the
same fixed windows at every evaluation, so one run's validation curve is comparable across its steps
and with any other run of the same data and seed.

Without `val_path` the last `val_fraction` of the tokens (of the files in order) is held out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddp_lab.data.files import DataError, expand, max_token, open_tokens
from ddp_lab.data.text import BYTE_VOCAB, check_utf8, python_docs

TRAIN, VAL = 0, 1  # a split's stream of the generator
_MAX_TOKEN: dict[tuple, int] = {}  # (file, size, mtime): its largest id, read once per process (a sweep's points)


@dataclass
class Split:
    arrays: list[np.ndarray]
    window: int  # tokens per window: context_length + 1
    stream: int

    def __post_init__(self):
        starts = [max(0, len(a) - self.window + 1) for a in self.arrays]
        self.cumulative = np.cumsum([0, *starts])

    @property
    def tokens(self) -> int:
        return sum(len(a) for a in self.arrays)

    @property
    def windows(self) -> int:
        return int(self.cumulative[-1])

    def batch(self, step: int, seed: int, batch_size: int, rows: slice = slice(None)) -> np.ndarray:
        """Rows `rows` of step `step`'s global batch: (rows, window) int64 token ids."""
        starts = np.random.default_rng([seed, step, self.stream]).integers(0, self.windows, size=batch_size)[rows]
        out = np.empty((len(starts), self.window), dtype=np.int64)
        for i, start in enumerate(starts):
            k = int(np.searchsorted(self.cumulative, start, side="right")) - 1
            offset = int(start - self.cumulative[k])
            out[i] = self.arrays[k][offset:offset + self.window]
        return out


@dataclass
class TokenData:
    train: Split
    val: Split | None
    files: list[str]
    fixed_vocab: int | None  # 256 for byte-level text; None where the tokenizer decides
    whole: list[np.ndarray]  # each file's tokens

    def max_token(self) -> int:
        """The largest token id in any file (text: 255, the largest a byte can be)."""
        if self.fixed_vocab is not None:
            return self.fixed_vocab - 1
        tops = []
        for f, tokens in zip(self.files, self.whole):
            stat = Path(f).stat()
            key = (f, stat.st_size, stat.st_mtime_ns)
            if key not in _MAX_TOKEN:
                _MAX_TOKEN[key] = max_token(tokens)
            tops.append(_MAX_TOKEN[key])
        return max(tops)

    def facts(self) -> dict:
        return {"files": self.files, "train_tokens": self.train.tokens,
                "val_tokens": self.val.tokens if self.val is not None else 0}


def open_data(data, context_length: int) -> TokenData:
    """`data=text` or `data=tokens`, from its config node; DataError for anything a rank could not train on."""
    window = context_length + 1
    if data.name == "text":
        files = expand(data.path) if data.path else [python_docs()]
        for f in files:
            check_utf8(f)
        arrays = [open_tokens(f, "raw", "uint8") for f in files]
        val_files = expand(data.val_path) if data.val_path else []
        val_arrays = [open_tokens(f, "raw", "uint8") for f in val_files]
        fixed_vocab = BYTE_VOCAB
    else:
        files, val_files = expand(data.path), expand(data.val_path) if data.val_path else []
        arrays = [open_tokens(f, data.format, data.dtype) for f in files]
        val_arrays = [open_tokens(f, data.format, data.dtype) for f in val_files]
        fixed_vocab = None
    for f, a in zip(files + val_files, arrays + val_arrays):
        if len(a) < window:
            raise DataError(f"{f}: {len(a)} tokens, fewer than one sequence plus one "
                            f"(model.context_length + 1 = {window})")
    whole = arrays + val_arrays
    if not data.val_path:
        arrays, val_arrays = _hold_out(arrays, data.val_fraction)
    train = Split(arrays, window, TRAIN)
    val = Split(val_arrays, window, VAL) if val_arrays or data.val_path else None
    if train.windows == 0:
        raise DataError(f"data.val_fraction={data.val_fraction} leaves no training sequence of {window} tokens")
    if val is not None and val.windows == 0:
        raise DataError(f"the validation split ({val.tokens} tokens) has no sequence of {window} tokens "
                        "(model.context_length + 1): raise data.val_fraction or use data.val_path")
    return TokenData(train, val, [str(f) for f in files + val_files], fixed_vocab, whole)



def _hold_out(arrays: list[np.ndarray], fraction: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The first (1 - fraction) of the tokens, in file order, and the rest."""
    total = sum(len(a) for a in arrays)
    keep = total - int(round(total * fraction))
    train, val, seen = [], [], 0
    for a in arrays:
        cut = min(max(keep - seen, 0), len(a))
        if cut > 0:
            train.append(a[:cut])
        if cut < len(a):
            val.append(a[cut:])
        seen += len(a)
    if fraction > 0 and not val:
        val = [arrays[-1][len(arrays[-1]):]]  # an empty split, refused by the caller
    return train, val
