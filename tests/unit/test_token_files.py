"""ddp_lab/data: token files in each format read back as written, splits and windows, the built-in text.
No process group: the files are written here, on the fly."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from ddp_lab.data.files import DataError, expand, open_tokens
from ddp_lab.data.split import Split, open_data
from ddp_lab.data.text import python_docs
from ddp_lab.rank.data import BatchSource
from tests.helpers.token_files import LLMC_UINT32, write_llmc, write_raw

TOKENS = np.arange(1000) % 300


@pytest.mark.parametrize("write, name", [
    (lambda p: write_raw(p, TOKENS), "train.bin"),
    (lambda p: write_raw(p, TOKENS, np.uint32), "train.u32"),
    (lambda p: write_llmc(p, TOKENS), "fineweb_train_000001.bin"),
    (lambda p: write_llmc(p, TOKENS + 100_000, LLMC_UINT32), "llama_000001.bin"),
    (lambda p: np.save(p, TOKENS.astype(np.uint16)) or p, "tokens.npy"),
])
def test_every_format_reads_back_what_was_written(tmp_path, write, name):
    path = write(tmp_path / name)
    dtype = "uint32" if name.endswith(".u32") else "uint16"
    tokens = open_tokens(path, "auto", dtype)
    expected = TOKENS + (100_000 if name.startswith("llama") else 0)
    assert isinstance(tokens, np.memmap) and np.array_equal(tokens, expected)


@pytest.mark.parametrize("write, fmt, message", [
    (lambda p: write_llmc(p, TOKENS, (20240520, 2)), "auto", "llm.c magic 20240520 with version 2, expected version 1"),
    (lambda p: write_llmc(p, TOKENS, (12345, 1)), "llmc", "llm.c magic 12345, expected 20240520"),
    (lambda p: write_llmc(p, TOKENS, count=999), "auto", "the llm.c header says 999 tokens"),
    (lambda p: (p.write_bytes(b"\x01\x02\x03"), p)[1], "raw", "3 bytes is not a whole number of uint16 tokens"),
    (lambda p: (p.write_bytes(b""), p)[1], "raw", "the file is empty"),
    (lambda p: np.save(p, TOKENS.astype(np.int64)) or p, "npy", "a .npy of int64, expected uint16 or uint32"),
])
def test_a_bad_file_is_one_line_naming_it(tmp_path, write, fmt, message):
    path = write(tmp_path / ("x.npy" if fmt == "npy" else "x.bin"))
    with pytest.raises(DataError, match=message) as error:
        open_tokens(path, fmt)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_folder_or_a_glob_names_its_shards_in_order(tmp_path):
    for i in (2, 0, 1):
        write_llmc(tmp_path / f"shard_{i}.bin", TOKENS)
    (tmp_path / "README.txt").write_text("not a shard")
    assert [p.name for p in expand(str(tmp_path))] == ["shard_0.bin", "shard_1.bin", "shard_2.bin"]
    assert [p.name for p in expand(str(tmp_path / "shard_[01].bin"))] == ["shard_0.bin", "shard_1.bin"]
    with pytest.raises(DataError, match="no such file"):
        expand(str(tmp_path / "missing.bin"))


def test_windows_stay_inside_one_file_and_every_rank_draws_the_same_starts():
    a, b = np.arange(0, 10), np.arange(100, 105)
    split = Split([a, b], window=4, stream=0)
    assert split.windows == 7 + 2
    batch = split.batch(3, seed=1, batch_size=64)
    assert all(np.array_equal(row, np.arange(row[0], row[0] + 4)) for row in batch)  # consecutive: one file
    assert {int(row[0]) for row in batch} <= set(range(0, 7)) | {100, 101}
    halves = [split.batch(3, seed=1, batch_size=64, rows=slice(r * 32, (r + 1) * 32)) for r in range(2)]
    assert np.array_equal(np.concatenate(halves), batch)
    assert not np.array_equal(split.batch(4, seed=1, batch_size=64), batch)


def _cfg(data: dict, batch_size=8, context_length=16, vocab_size=300):
    return OmegaConf.create({"data": {"val_path": None, "val_fraction": 0.1, "format": "auto", "dtype": "uint16",
                                      **data},
                             "train": {"batch_size": batch_size, "seed": 3, "grad_accum_steps": 2, "eval_batches": 2},
                             "model": {"context_length": context_length, "vocab_size": vocab_size}})


def test_the_last_tenth_is_held_out_and_the_ranks_tile_each_batch(tmp_path):
    path = write_raw(tmp_path / "train.bin", TOKENS)
    cfg = _cfg({"name": "tokens", "path": str(path)})
    data = open_data(cfg.data, 16)
    assert data.train.tokens == 900 and data.val.tokens == 100
    assert int(np.concatenate(data.val.arrays)[0]) == TOKENS[900]
    pieces = [x for rank in range(2) for x, _ in BatchSource(cfg, rank, 2, torch.device("cpu")).micro_batches(5)]
    whole = data.train.batch(5, 3, 8)
    assert torch.equal(torch.cat(pieces), torch.from_numpy(whole[:, :-1]))
    held = [BatchSource(cfg, rank, 2, torch.device("cpu")).held_out_batches() for rank in range(2)]
    assert len(held[0]) == 2 and int(held[0][0][0].max()) >= 0
    assert torch.equal(held[0][0][0], BatchSource(cfg, 0, 2, torch.device("cpu")).held_out_batches()[0][0])  # fixed


def test_an_empty_validation_split_and_a_short_file_are_refused(tmp_path):
    path = write_raw(tmp_path / "train.bin", TOKENS)
    with pytest.raises(DataError, match="the validation split .* has no sequence of 17 tokens"):
        open_data(_cfg({"name": "tokens", "path": str(path), "val_fraction": 0.01}).data, 16)
    short = write_raw(tmp_path / "short.bin", TOKENS[:16])
    with pytest.raises(DataError, match="16 tokens, fewer than one sequence plus one"):
        open_data(_cfg({"name": "tokens", "path": str(short)}).data, 16)


def test_the_built_in_text_is_written_once_and_read_as_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_LAB_CACHE", str(tmp_path))
    path = python_docs()
    assert path.parent == tmp_path and path.stat().st_size > 100_000
    assert "assignment" in path.read_text(encoding="utf-8")  # the reference manual's prose
    data = open_data(_cfg({"name": "text", "path": None}).data, 16)
    assert data.fixed_vocab == 256 and data.max_token() == 255
    assert data.train.tokens + data.val.tokens == path.stat().st_size
    not_text = write_raw(tmp_path / "tokens.bin", np.arange(50000, 60000))
    with pytest.raises(DataError, match="not UTF-8 text"):
        open_data(_cfg({"name": "text", "path": str(not_text)}).data, 16)
