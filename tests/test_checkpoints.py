"""Checkpoints are written completely or not at all; retention keeps the last K and the best."""

import json
from pathlib import Path

import pytest

from rlplatform.run.checkpoints import CheckpointManager, latest_checkpoint, list_checkpoints
from rlplatform.errors import UserError


def fake_rllib_writer(path: str) -> None:
    """Stands in for Algorithm.save_to_path: the same layout, tiny files."""
    root = Path(path)
    (root / "learner_group" / "learner" / "rl_module" / "default_policy").mkdir(parents=True)
    (root / "rllib_checkpoint.json").write_text(json.dumps({"checkpoint_version": "2.1"}))


def crashing_writer(path: str) -> None:
    fake_rllib_writer(path)
    raise OSError("disk full")


def save(manager: CheckpointManager, iteration: int, score: float, writer=fake_rllib_writer) -> Path:
    return manager.save(writer, iteration=iteration, env_steps=iteration * 100, score=score, meta={})


def test_crash_mid_write_leaves_the_previous_checkpoint_as_latest(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=3, keep_best=True)
    save(manager, 1, score=1.0)
    with pytest.raises(OSError):
        save(manager, 2, score=2.0, writer=crashing_writer)
    assert latest_checkpoint(tmp_path).iteration == 1
    assert list((tmp_path / "checkpoints").glob(".partial-*"))  # the torn write is there, but never listed
    CheckpointManager(tmp_path / "checkpoints", keep_last=3, keep_best=True)  # a later run cleans it up
    assert not list((tmp_path / "checkpoints").glob(".partial-*"))


def test_keeps_last_k_plus_best(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=2, keep_best=True)
    for iteration, score in [(1, 5.0), (2, 50.0), (3, 7.0), (4, 8.0), (5, 9.0)]:
        save(manager, iteration, score)
    assert [c.iteration for c in list_checkpoints(tmp_path / "checkpoints")] == [2, 4, 5]


def test_without_keep_best_only_last_k_remain(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=1, keep_best=False)
    for iteration in range(1, 4):
        save(manager, iteration, score=100.0 - iteration)
    assert [c.iteration for c in list_checkpoints(tmp_path / "checkpoints")] == [3]


def test_no_checkpoint_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no complete checkpoint"):
        latest_checkpoint(tmp_path)
