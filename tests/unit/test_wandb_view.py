"""The W&B view of a sweep, offline: the keys a sweep varied, how W&B addresses them, the publish refusals."""

import pytest

from ddp_lab.analysis import wandb_view


def test_varied_keys_are_what_differs_but_bookkeeping():
    configs = [{"strategy": {"_target_": "a.NaiveSpec", "name": "naive"}, "world_size": 2, "train": {"seed": 0},
                "logger": {"group": "g", "dir": "/x"}, "model": {"name": "tiny"}},
               {"strategy": {"_target_": "a.FlatSpec", "name": "flat", "bucket_mb": 25}, "world_size": 4,
                "train": {"seed": 1}, "logger": {"group": "g", "dir": "/y"}, "model": {"name": "tiny"}}]
    assert wandb_view.varied_keys(configs) == ["strategy.name", "world_size", "strategy.bucket_mb"]
    assert [wandb_view.config_key(k) for k in ("strategy.bucket_mb", "world_size")] == \
        ["strategy.value.bucket_mb", "world_size"]


def test_publish_refuses_in_one_line_before_uploading(tmp_path):
    with pytest.raises(wandb_view.PublishError, match="ENTITY/PROJECT"):
        wandb_view.publish(tmp_path, "no-slash")
    with pytest.raises(wandb_view.PublishError, match="no W&B runs under"):
        wandb_view.publish(tmp_path, "someone/ddp-lab")
