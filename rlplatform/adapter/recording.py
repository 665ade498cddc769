"""A training run's sampled episodes, written as they finish (`record:`), in RLlib's offline format.

Each env runner keeps the chunks of the episodes it is sampling (RLlib cuts an episode at every fragment's end)
through RLlib's `on_sample_end` callback, joins an episode's chunks when it finishes and writes finished episodes to
its own Parquet files under the record path (adapter/offline_data.py's format, the one RLlib's recording runner
writes and its offline reader reads). The callback sees the episodes on every sampling path: RLlib's own, the lean
and columnar ones, the torch-free runner. Evaluation runners record nothing.

Not RLlib's recording runner (`offline_data(output=...)`): it is used only when `env_runner_cls` is unset (no lean
sampler), it needs `batch_mode: complete_episodes` (which changes what PPO trains on), and its writes are Ray Data
tasks that ask a CPU outside the run's placement group (docs/offline.md).
"""

from __future__ import annotations

import os
import secrets
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlplatform.adapter.offline_data import encode_items, write_items

# The recorders of this process, one per env runner, so a flush reaches them all (see `flush`).
_RECORDINGS: "weakref.WeakKeyDictionary[Any, RunnerRecording]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class RecordSettings:
    path: str  # an absolute directory
    episodes_per_file: int
    flush_s: float


@dataclass
class _Parts:
    """An episode being sampled, as lists of per-step items (what RLlib's episode constructor takes)."""

    observations: list = field(default_factory=list)
    infos: list = field(default_factory=list)
    actions: list = field(default_factory=list)
    rewards: list = field(default_factory=list)
    extra: dict[str, list] = field(default_factory=dict)


class RunnerRecording:
    """One env runner's recording: episodes being sampled, finished ones not yet written, and its files."""

    def __init__(self, settings: RecordSettings, worker_index: int):
        self.settings = settings
        # Names unique across runner restarts and resumed runs: `<runner>-<process>-<random>-<file number>`.
        self.prefix = f"runner{worker_index:03d}-{os.getpid()}-{secrets.token_hex(3)}"
        self.pending: dict[str, _Parts] = {}
        self.finished: list[Any] = []
        self.files = 0
        self.written = 0
        self.last_write = time.monotonic()

    def add(self, chunks: list) -> None:
        for chunk in chunks:
            parts = self.pending.get(chunk.id_)
            if parts is None:
                if chunk.t_started != 0:  # begun before this runner recorded (a restarted runner): not whole
                    continue
                parts = self.pending[chunk.id_] = _Parts()
            _extend(parts, chunk)
            if chunk.is_done:
                del self.pending[chunk.id_]
                self.finished.append(_episode(chunk, parts))
        full = len(self.finished) >= self.settings.episodes_per_file
        if full or (self.finished and time.monotonic() - self.last_write >= self.settings.flush_s):
            self.write()

    def write(self) -> int:
        """Write the finished episodes held (in files of at most `episodes_per_file`); how many."""
        count = 0
        while self.finished:
            batch = self.finished[: self.settings.episodes_per_file]
            self.finished = self.finished[len(batch):]
            self.files += 1
            write_items(encode_items(batch), Path(self.settings.path) / f"{self.prefix}-{self.files:05d}.parquet")
            count += len(batch)
        self.written += count
        self.last_write = time.monotonic()
        return count


def record_samples(*, env_runner: Any, samples: list, settings: RecordSettings, **_: Any) -> None:
    """RLlib's `on_sample_end` callback (bound to the settings by `callback`)."""
    if env_runner.config.in_evaluation:
        return
    recorder = _RECORDINGS.get(env_runner)
    if recorder is None:
        recorder = _RECORDINGS[env_runner] = RunnerRecording(settings, env_runner.worker_index)
    recorder.add(samples)


def callback(settings: RecordSettings) -> Any:
    import functools

    return functools.partial(record_samples, settings=settings)


def flush_this_process(_runner: Any = None) -> int:
    """Write what every recorder in this process holds; the number of episodes written."""
    return sum(recorder.write() for recorder in list(_RECORDINGS.values()))


def flush(algo: Any) -> int:
    """Write the finished episodes every env runner of the algorithm holds (before a checkpoint, at the end)."""
    group = getattr(algo, "env_runner_group", None)
    if group is None:
        return flush_this_process()
    return sum(group.foreach_env_runner(flush_this_process, local_env_runner=True))


def _items(values: Any, numpy: bool) -> list:
    """A chunk's column as a list of per-step items, whether the chunk holds lists or (numpy'd) batched arrays."""
    if not numpy:
        return list(values)
    if isinstance(values, np.ndarray):
        return list(values)
    from ray.rllib.utils.spaces.space_utils import unbatch

    return unbatch(values)


def _extend(parts: _Parts, chunk: Any) -> None:
    """Add a chunk's steps; a chunk after the first repeats the observation (and info) the previous one ended on."""
    numpy, skip = chunk.is_numpy, 0 if chunk.t_started == 0 else 1
    parts.observations.extend(_items(chunk.get_observations(), numpy)[skip:])
    parts.infos.extend(list(chunk.get_infos())[skip:])
    parts.actions.extend(_items(chunk.get_actions(), numpy))
    parts.rewards.extend(float(r) for r in _items(chunk.get_rewards(), numpy))
    for key in chunk.extra_model_outputs.keys():
        parts.extra.setdefault(key, []).extend(_items(chunk.get_extra_model_outputs(key), numpy))


def _episode(last: Any, parts: _Parts) -> Any:
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    episode = SingleAgentEpisode(
        id_=last.id_, observations=parts.observations, infos=parts.infos, actions=parts.actions,
        rewards=parts.rewards, extra_model_outputs=parts.extra or None,
        terminated=last.is_terminated, truncated=last.is_truncated,
        observation_space=last.observation_space, action_space=last.action_space, len_lookback_buffer=0)
    episode.to_numpy()  # one array per column: packed once, not step by step
    return episode
