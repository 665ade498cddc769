"""Checkpoints are written completely or not at all; retention keeps the last K and the best."""

import json
from pathlib import Path

import pytest

from rlplatform.errors import UserError
from rlplatform.run.checkpoints import (
    CheckpointManager,
    best_first,
    checked,
    first_usable,
    latest_checkpoint,
    list_checkpoints,
    newest_first,
    read_checkpoint,
    verify,
)


def fake_rllib_writer(path: str) -> None:
    """Stands in for Algorithm.save_to_path: the same layout, small files."""
    root = Path(path)
    (root / "learner_group" / "learner" / "rl_module" / "default_policy").mkdir(parents=True)
    (root / "rllib_checkpoint.json").write_text(json.dumps({"checkpoint_version": "2.1"}))
    (root / "learner_group" / "learner" / "rl_module" / "default_policy" / "weights.bin").write_bytes(bytes(range(256)) * 16)


def crashing_writer(path: str) -> None:
    fake_rllib_writer(path)
    raise OSError("disk full")


def save(manager: CheckpointManager, iteration: int, score: float, writer=fake_rllib_writer) -> Path:
    return manager.save(writer, iteration=iteration, env_steps=iteration * 100, score=score, meta={})


def test_a_failed_write_leaves_the_previous_checkpoint_as_latest_and_nothing_half_written(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=3, keep_best=True)
    save(manager, 1, score=1.0)
    with pytest.raises(OSError):
        save(manager, 2, score=2.0, writer=crashing_writer)
    assert latest_checkpoint(tmp_path).iteration == 1
    assert not list((tmp_path / "checkpoints").glob(".partial-*"))
    assert verify(latest_checkpoint(tmp_path)) is None


def test_a_process_killed_mid_write_leaves_a_partial_that_is_never_listed_and_later_removed(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=3, keep_best=True)
    save(manager, 1, score=1.0)
    fake_rllib_writer(str(tmp_path / "checkpoints" / ".partial-000002"))  # what SIGKILL mid-write leaves
    assert latest_checkpoint(tmp_path).iteration == 1
    CheckpointManager(tmp_path / "checkpoints", keep_last=3, keep_best=True)  # a later run cleans it up
    assert not list((tmp_path / "checkpoints").glob(".partial-*"))


def test_each_file_is_recorded_with_size_and_hash_and_any_damage_is_named(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=3, keep_best=True)
    info = read_checkpoint(save(manager, 1, score=1.0))
    assert set(info.meta["files"]) == {"rllib_checkpoint.json", "learner_group/learner/rl_module/default_policy/weights.bin"}
    assert info.meta["versions"]["ray"] and info.meta["versions"]["torch"]
    assert verify(info) is None
    weights = info.path / "learner_group/learner/rl_module/default_policy/weights.bin"
    weights.write_bytes(weights.read_bytes()[:100])
    assert verify(info) == "learner_group/learner/rl_module/default_policy/weights.bin has 100 bytes, 4,096 were written"
    weights.write_bytes(bytes(4096))
    assert "changed since it was written" in verify(info)
    weights.unlink()
    assert verify(info) == "learner_group/learner/rl_module/default_policy/weights.bin is missing"


def test_resume_order_takes_the_first_that_verifies_and_loads_and_names_the_others(tmp_path, capsys):
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=5, keep_best=True)
    for iteration, score in [(1, 1.0), (2, 9.0), (3, 3.0)]:
        save(manager, iteration, score)
    newest = read_checkpoint(tmp_path / "checkpoints" / "checkpoint_000003")
    (newest.path / "rllib_checkpoint.json").write_text("{}")  # damaged after it was written

    def loads(info):
        if info.iteration == 2:
            raise UserError("checkpoint_000002 cannot be loaded: bad pickle")

    chosen = first_usable(newest_first(list_checkpoints(tmp_path / "checkpoints")), loads, tmp_path)
    assert chosen.iteration == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith("skipped 2 checkpoint(s)") and "checkpoint_000003: rllib_checkpoint.json" in line
    assert "checkpoint_000002: checkpoint_000002 cannot be loaded" in line
    assert [c.iteration for c in best_first(list_checkpoints(tmp_path / "checkpoints"))] == [2, 3, 1]
    with pytest.raises(UserError, match="is not whole: rllib_checkpoint.json"):
        checked(newest, loads)
    with pytest.raises(UserError, match="verifies and loads: checkpoint_000003"):
        first_usable([newest], loads, tmp_path)


def test_resuming_moves_the_checkpoints_of_lost_iterations_aside(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=5, keep_best=False)
    for iteration in (2, 4, 5):
        save(manager, iteration, score=None)
    moved = manager.roll_back_after(4)
    assert [p.name for p in moved] == ["checkpoint_000005"] and moved[0].parent.name == "rolled_back"
    assert [c.iteration for c in list_checkpoints(tmp_path / "checkpoints")] == [2, 4]
    save(manager, 5, score=None)  # the rerun iteration writes its own
    assert manager.roll_back_after(4)[0].name == "checkpoint_000005.2"  # a second roll-back keeps the first


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


def test_a_checkpoint_from_another_ray_release_warns_once_with_what_to_do(tmp_path, capsys):
    from rlplatform.run.checkpoints import warn_if_other_ray

    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=5, keep_best=False)
    info = read_checkpoint(save(manager, 1, score=None))
    warn_if_other_ray(info)
    assert capsys.readouterr().err == ""  # written by this very Ray
    info.meta["versions"]["ray"] = "2.59.1"
    warn_if_other_ray(info)
    warn_if_other_ray(info)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "written by ray 2.59.1" in lines[0] and "install ray==2.59.1" in lines[0]
