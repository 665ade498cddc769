"""Minari datasets as episodes in RLlib's offline format (`data.minari`), read locally, never downloaded.

A Minari dataset (`minari.load_dataset(id)` under `$MINARI_DATASETS_PATH`, or a dataset directory) is converted
once into Parquet files of packed `SingleAgentEpisode`s (adapter/offline_data.py) under the cache directory, keyed
by the dataset's id and size; RLlib's reader then trains on them like any recording. Box actions are stored as
RLlib's recordings store them, in the module's space: scaled to [-1, 1] where the Box is bounded
(`normalize_actions`, RLlib's default).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import gymnasium as gym

from rlplatform.adapter.offline_data import episode_from_steps
from rlplatform.config.layouts import cache_root
from rlplatform.errors import UserError

EPISODES_PER_FILE = 1000
DONE_MARK = "converted.json"


def open_dataset(source: str) -> Any:
    """The Minari dataset `source` names: a dataset directory (holding `data/`) or an id of a local dataset."""
    try:
        import minari
        from minari import MinariDataset
    except ImportError:
        raise UserError("data.minari needs Minari: pip install 'minari[hdf5]' (or the `offline` extra)") from None
    path = Path(source).expanduser()
    try:
        if path.is_dir():
            return MinariDataset(path / "data" if (path / "data").is_dir() else path)
        return minari.load_dataset(source)  # local only: download=False
    except FileNotFoundError:
        raise UserError(f"data.minari: no local Minari dataset {source[:200]!r} (looked under $MINARI_DATASETS_PATH or "
                        "~/.minari/datasets; `minari download ID` fetches one)") from None
    except Exception as exc:  # a damaged or foreign directory
        raise UserError(f"data.minari: {source[:200]}: not a readable Minari dataset ({type(exc).__name__}: "
                        f"{str(exc)[:200]})") from None


def converted(source: str) -> Path:
    """The directory of RLlib-format episodes converted from the Minari dataset (converted now if not yet)."""
    dataset = open_dataset(source)
    spaces = (dataset.observation_space, dataset.action_space)
    for space in spaces:
        if not isinstance(space, (gym.spaces.Box, gym.spaces.Discrete)):
            raise UserError(f"data.minari: {source}: a {type(space).__name__} space; Box and Discrete only")
    name = str(getattr(dataset.spec, "dataset_id", None) or Path(source).name).replace("/", "_")
    out = cache_root() / "minari" / f"{name}-{dataset.total_episodes}ep-{dataset.total_steps}steps"
    if not (out / DONE_MARK).is_file():
        _convert(dataset, out)
    return out


def _convert(dataset: Any, out: Path) -> None:
    from rlplatform.adapter.offline_data import write_part

    for old in out.glob("*.parquet"):  # an earlier conversion that stopped half-way
        old.unlink()
    batch, part = [], 0
    for episode in episodes(dataset):
        batch.append(episode)
        if len(batch) == EPISODES_PER_FILE:
            write_part(batch, out / f"episodes-{part:06d}.parquet")
            batch, part = [], part + 1
    if batch:
        write_part(batch, out / f"episodes-{part:06d}.parquet")
    (out / DONE_MARK).write_text(json.dumps({"episodes": dataset.total_episodes, "env_steps": dataset.total_steps}) + "\n")


def episodes(dataset: Any) -> Iterator[Any]:
    """Each Minari episode as RLlib's `SingleAgentEpisode` (observations T+1, actions, rewards, how it ended)."""
    for data in dataset.iterate_episodes():
        steps = len(data.rewards)
        # an episode the collector cut off (neither flag set) counts as truncated: it ended without a terminal state
        yield episode_from_steps(data.observations[: steps + 1], data.actions[:steps], data.rewards,
                                 terminated=bool(data.terminations[-1]),
                                 spaces=(dataset.observation_space, dataset.action_space))
