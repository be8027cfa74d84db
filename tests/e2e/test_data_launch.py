"""data=text and data=tokens through launch.py: the held-out loss falls on text and on token files the
test writes (nanoGPT's headerless .bin, an llm.c shard); every bad data input is one line and exit 2
before any rank starts, nothing written (in this process, through the pre-launch check)."""

import numpy as np
import pytest

from ddp_lab.config import register_configs
from ddp_lab.launcher.preflight import EXIT_BAD_INPUT, check_command_line
from tests.helpers.launching import NARROW, ROOT, launch, results
from tests.helpers.token_files import counting_tokens, write_llmc, write_raw

register_configs()


def _files(tmp_path):
    """Token files, each with the mistake its name says (the tiny model: context 64, vocab 10000)."""
    ok = counting_tokens(4000, 10000)
    return {
        "good": write_raw(tmp_path / "good.bin", ok),
        "bad_magic": write_llmc(tmp_path / "bad_magic.bin", ok, (20240521, 1)),
        "bad_version": write_llmc(tmp_path / "bad_version.bin", ok, (20240520, 7)),
        "bad_count": write_llmc(tmp_path / "bad_count.bin", ok, count=3999),
        "short": write_raw(tmp_path / "short.bin", ok[:64]),
        "big_ids": write_raw(tmp_path / "big_ids.bin", np.append(ok, 29999)),
        "utf16": (tmp_path / "utf16.txt", (tmp_path / "utf16.txt").write_bytes("ƒ text".encode("utf-16") * 500))[0],
    }


CASES = {  # overrides ({name}: a file of _files) -> a phrase of the one line
    "data=tokens": "data=tokens needs data.path=FILE",
    "data=tokens data.path={good}.missing": "no such file",
    "data=tokens data.path={bad_magic} data.format=llmc": "llm.c magic 20240521, expected 20240520",
    "data=tokens data.path={bad_version}": "llm.c magic 20240520 with version 7, expected version 1",
    "data=tokens data.path={bad_count}": "the llm.c header says 3999 tokens",
    "data=tokens data.path={short}": "64 tokens, fewer than one sequence plus one (model.context_length + 1 = 65)",
    "data=tokens data.path={good} data.val_fraction=0.01": "the validation split (40 tokens) has no sequence",
    "data=tokens data.path={good} data.val_fraction=1": "data.val_fraction must be in [0, 1)",
    "data=tokens data.path={good} data.dtype=int64": "Invalid value 'int64', expected one of [uint16, uint32]",
    "data=tokens data.path={big_ids}": "token ids up to 29999, but model.vocab_size=10000",
    "data=text data.path={utf16}": "not UTF-8 text",
    "data=text model.vocab_size=200": "token ids up to 255, but model.vocab_size=200",
    "data=synthetic data.path=x.bin": "path",
    "train.eval_every=-1": "train.eval_every must be >= 0",
}


@pytest.mark.parametrize("overrides", list(CASES), ids=list(CASES))
def test_bad_data_is_refused_by_the_pre_launch_check(overrides, tmp_path, capsys):
    args = [*overrides.format(**_files(tmp_path)).split(), f"hydra.run.dir={tmp_path / 'run'}"]
    with pytest.raises(SystemExit) as exit_:
        check_command_line(ROOT / "conf", "config", args)
    assert exit_.value.code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert CASES[overrides] in err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_text_sets_the_vocabulary_and_the_command_line_still_wins(tmp_path, capsys):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        assert compose("config", overrides=["data=text"]).model.vocab_size == 256
        assert compose("config", overrides=["data=text", "model.vocab_size=512"]).model.vocab_size == 512
        assert compose("config", overrides=["data=tokens", "data.path=x"]).model.vocab_size == 10000


@pytest.mark.slow
def test_text_trains_and_its_validation_loss_falls(tmp_path):
    proc = launch("data=text", *NARROW, "logger=none", "train.steps=30", "train.eval_every=10", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = results(tmp_path / "run")
    held_out = [(s["step"], s["val_loss"]) for s in res["steps"] if "val_loss" in s]
    assert [step for step, _ in held_out] == [9, 19, 29]
    assert held_out[-1][1] < held_out[0][1] < 5.0   # ln(256) = 5.5 at chance
    assert res["summary"]["final_val_loss"] == held_out[-1][1]
    assert res["config"]["model"]["vocab_size"] == 256
    assert res["summary"]["data"]["val_tokens"] > 0


@pytest.mark.slow
def test_token_files_train_nanogpt_bin_and_llmc_shard(tmp_path):
    """A folder holding a nanoGPT .bin and an llm.c shard, each format found by itself (format=auto; each read
    back as written: tests/unit/test_token_files.py): one job trains on both, its held-out loss falling."""
    tokens = counting_tokens(20000, 1000)
    shards = tmp_path / "shards"
    shards.mkdir()
    files = [write_raw(shards / "train.bin", tokens), write_llmc(shards / "fineweb_train_000001.bin", tokens)]
    proc = launch("data=tokens", f"data.path={shards}", "model=toy", "logger=none", "train.steps=20",
                  "train.eval_every=5", "train.lr=1e-2", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = results(tmp_path / "run")
    assert res["status"] == "ok" and res["summary"]["data"]["files"] == sorted(str(path) for path in files)
    held_out = [s["val_loss"] for s in res["steps"] if "val_loss" in s]
    assert len(held_out) == 4 and held_out[-1] < 0.8 * held_out[0]
