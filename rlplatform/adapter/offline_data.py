"""Episodes on disk in RLlib's offline format, and what a dataset of them holds.

RLlib's recording env runner (`OfflineSingleAgentEnvRunner`, `offline_data(output_write_episodes=True)`)
writes Parquet files with one column, `item`: each row one episode's `get_state()` packed with msgpack,
numpy arrays by msgpack_numpy. Its offline reader (`OfflinePreLearner`, `input_read_episodes=True`) decodes
that column with `SingleAgentEpisode.from_state`. Files written here have that form, so RLlib's offline
algorithms read them as they read their own recordings; files RLlib wrote are read here too.

Written directly with pyarrow, one file per writer: RLlib's writer goes through Ray Data write tasks (a
CPU each, outside the run's placement group) and, without `output_max_rows_per_file`, rewrites its whole
buffer at every sample (docs/offline.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import gymnasium as gym
import numpy as np
from ray.rllib.env.single_agent_episode import SingleAgentEpisode

from rlplatform.config.schema import BOX_ACTION_ALGORITHMS, REQUIRED_TRANSITION_COLUMNS
from rlplatform.errors import UserError

ITEM = "item"  # the column RLlib writes (ray.data.from_items of the packed episodes) and reads
DATASET_FILE = "dataset.json"
FORMAT = {"name": "rllib-episodes", "column": ITEM,
          "encoding": "msgpack (msgpack_numpy arrays) of SingleAgentEpisode.get_state(), one finished episode per row"}


def encode(episode: SingleAgentEpisode) -> bytes:
    """One episode as RLlib's recording runner packs it."""
    import msgpack
    import msgpack_numpy

    return msgpack.packb(episode.get_state(), default=msgpack_numpy.encode)


def decode(item: bytes) -> SingleAgentEpisode:
    """One packed episode, as RLlib's offline reader unpacks it."""
    import msgpack
    import msgpack_numpy

    return SingleAgentEpisode.from_state(msgpack.unpackb(item, object_hook=msgpack_numpy.decode))


def episode_from_steps(observations: Sequence[Any], env_actions: Sequence[Any], rewards: Sequence[float], terminated: bool,
                       spaces: tuple[gym.Space, gym.Space]) -> SingleAgentEpisode:
    """A finished episode played outside RLlib (observations T+1, env actions T), as RLlib's recordings keep it:
    actions in the module's space (see `module_action`); `terminated` False means it was cut off (truncated)."""
    return SingleAgentEpisode(
        observations=[np.asarray(o) for o in observations], actions=[module_action(a, spaces[1]) for a in env_actions],
        rewards=[float(r) for r in rewards], terminated=terminated, truncated=not terminated,
        observation_space=spaces[0], action_space=spaces[1], len_lookback_buffer=0)


def module_action(action: Any, space: gym.Space) -> Any:
    """An env action as RLlib's recordings keep it: a bounded Box scaled to [-1, 1] (RLlib's `normalize_actions`, which
    the runner undoes before stepping the env), a Discrete as an int."""
    from ray.rllib.utils.spaces.space_utils import normalize_action

    if isinstance(space, gym.spaces.Discrete):
        return int(action)
    action = np.asarray(action, dtype=space.dtype)
    if np.all(np.isfinite(space.low)) and np.all(np.isfinite(space.high)):
        return normalize_action(action, space).astype(space.dtype)
    return action


def write_part(episodes: Iterable[SingleAgentEpisode], path: Path) -> int:
    """Write the episodes (finished ones: RLlib's reader takes no others) to one Parquet file; their number."""
    return write_items(encode_items(episodes), path)


def encode_items(episodes: Iterable[SingleAgentEpisode]) -> list[bytes]:
    items = []
    for episode in episodes:
        if not episode.is_done:
            raise ValueError(f"episode {episode.id_} is not finished: offline readers take whole episodes only")
        items.append(encode(episode))
    return items


def write_items(items: list[bytes], path: Path) -> int:
    """One Parquet file of packed episodes, written beside and renamed into place: a reader (or a crash) never
    meets half a file under a `.parquet` name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    pq.write_table(pa.table({ITEM: pa.array(items, type=pa.binary())}), partial)
    os.replace(partial, path)
    return len(items)


def write_dataset_json(directory: Path, summary: "DatasetSummary", env: str, env_config: dict[str, Any],
                       source: dict[str, Any], describe_space: Any) -> dict[str, Any]:
    """`dataset.json` beside a dataset: its format, where it came from, and what it holds."""
    dataset = {"format": FORMAT, "env": env, "env_config": env_config, "source": source,
               **summary.as_dict(describe_space)}
    (directory / DATASET_FILE).write_text(json.dumps(dataset, indent=1) + "\n")
    return dataset


def holds_dataset(directory: Path) -> bool:
    return directory.is_dir() and ((directory / DATASET_FILE).exists() or any(directory.rglob("*.parquet")))


def parquet_files(path: Path) -> list[Path]:
    """The dataset's Parquet files: the file itself, or every one under the directory (as Ray Data reads them)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise UserError(f"no such dataset: {path}")
    files = sorted(p for p in path.rglob("*.parquet") if p.is_file())
    if not files:
        raise UserError(f"no Parquet files under {path}")
    return files


def read_episodes(path: Path) -> Iterator[SingleAgentEpisode]:
    """Every episode of the dataset, file by file; a file that is not episodes in RLlib's form is named."""
    return _read_files(parquet_files(path))


def _read_files(files: list[Path]) -> Iterator[SingleAgentEpisode]:
    import pyarrow.parquet as pq

    for file in files:
        try:
            parquet = pq.ParquetFile(file)
        except Exception as exc:  # truncated, or not Parquet at all
            raise UserError(f"{file}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
        if ITEM not in parquet.schema_arrow.names:
            raise UserError(f"{file}: no {ITEM!r} column: not episodes recorded in RLlib's format "
                            f"(columns: {', '.join(parquet.schema_arrow.names)})")
        for batch in parquet.iter_batches(columns=[ITEM], batch_size=256):
            for item in batch.column(0).to_pylist():
                try:
                    yield decode(item)
                except Exception as exc:
                    raise UserError(f"{file}: a row is not a packed episode ({type(exc).__name__}: {exc})") from None


@dataclass
class DatasetSummary:
    """What `data info` shows and `dataset.json` keeps."""

    episodes: int
    env_steps: int
    return_mean: float
    return_min: float
    return_max: float
    length_mean: float
    observation_space: gym.Space
    action_space: gym.Space
    files: int
    bytes: int
    finished: int  # episodes that ended (terminated or truncated): what offline readers take

    def as_dict(self, describe_space: Any) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if not k.endswith("_space")}
        out["observation_space"] = describe_space(self.observation_space)
        out["action_space"] = describe_space(self.action_space)
        return out


def summarize(path: Path) -> DatasetSummary:
    """Episodes, env steps, returns and spaces of a dataset, read through every episode once."""
    files = parquet_files(path)
    return summary_of(_read_files(files), files, source=path)


def summary_of(episodes: Iterable[SingleAgentEpisode], files: list[Path], source: Path) -> DatasetSummary:
    """The summary of these episodes, stored in these files (`source` names the dataset in an error)."""
    returns: list[float] = []
    lengths: list[int] = []
    finished = 0
    spaces: tuple[Any, Any] = (None, None)
    for episode in episodes:
        returns.append(float(episode.get_return()))
        lengths.append(len(episode))
        finished += bool(episode.is_done)
        if spaces == (None, None):
            spaces = (episode.observation_space, episode.action_space)
    if not returns:
        raise UserError(f"{source}: the dataset holds no episodes")
    return DatasetSummary(
        episodes=len(returns), env_steps=sum(lengths), return_mean=sum(returns) / len(returns),
        return_min=min(returns), return_max=max(returns), length_mean=sum(lengths) / len(lengths),
        observation_space=spaces[0], action_space=spaces[1], files=len(files),
        bytes=sum(f.stat().st_size for f in files), finished=finished,
    )


def play_episodes(checkpoint: Path, config: Any, episodes: int, explore: bool, seed: int,
                  module_id: Any = None) -> list[SingleAgentEpisode]:
    """A checkpoint's policy playing `episodes` whole episodes in one env, in this process, through RLlib's own
    env runner (its connectors, its episodes: module-space actions, their log-probabilities and distribution
    inputs), greedy or exploring. The episodes come as RLlib's recording runner keeps them (lists, not numpy)."""
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    from rlplatform.adapter.algorithm_config import build_algorithm_config
    from rlplatform.adapter.policy import load_inference_module

    module = load_inference_module(checkpoint, module_id)
    algo_config = build_algorithm_config(config.model_copy(update={"seed": seed}))
    algo_config.env_runners(num_envs_per_env_runner=1, episodes_to_numpy=False)
    runner = SingleAgentEnvRunner(config=algo_config)
    try:
        runner.module = module  # the trained policy in place of the freshly built one (the pipelines take it per call)
        played = runner.sample(num_episodes=episodes, explore=explore)
    finally:
        runner.stop()
    return [episode for episode in played if episode.is_done]


def is_uri(path: str) -> bool:
    """A path with a scheme (s3://, gs://, local://): Ray Data reads it, the driver does not check it."""
    return "://" in path


def resolved_paths(paths: Iterable[str]) -> list[str]:
    """The data paths as the run keeps them: local ones absolute (RLlib's reader and Ray's workers have their own
    working directories), URIs as given."""
    return [p if is_uri(p) else str(Path(p).expanduser().resolve()) for p in paths]


def check_dataset(paths: list[str], columns: Optional[dict[str, str]], spaces: tuple[gym.Space, gym.Space],
                  algorithm: str) -> None:
    """Refuse, before Ray starts, data an offline run cannot learn from: missing or empty files, files that are not
    Parquet, missing columns, observations or actions that do not fit the env's spaces. Reads each file's footer
    and its first row, not the whole dataset. `spaces`: the env's (observation space, action space)."""
    for path in paths:
        if is_uri(path):
            continue
        for file in parquet_files(Path(path)):
            first = _first_row(file, columns)
            if columns is None:
                _check_episode(file, _decoded(file, first[ITEM]), spaces)
            else:
                _check_transition(file, first, columns, spaces)
    if algorithm in BOX_ACTION_ALGORITHMS and not isinstance(spaces[1], gym.spaces.Box):
        raise UserError(f"{algorithm} learns a continuous (Box) action; the env's action space is {spaces[1]}")


def _decoded(file: Path, item: Any) -> SingleAgentEpisode:
    try:
        return decode(item)
    except Exception as exc:
        raise UserError(f"{file}: its first row is not a packed episode ({type(exc).__name__}: {exc})") from None


def mean_episode_length(paths: list[str], episodes: int = 16) -> Optional[float]:
    """The mean length of the first episodes of the first local file (None: no local file, or a table)."""
    import pyarrow.parquet as pq

    for path in paths:
        if is_uri(path):
            continue
        parquet = pq.ParquetFile(parquet_files(Path(path))[0])
        batch = next(parquet.iter_batches(batch_size=episodes, columns=[ITEM]))
        lengths = [len(decode(item)) for item in batch.column(0).to_pylist()]
        return sum(lengths) / len(lengths) if lengths else None
    return None


def _first_row(file: Path, columns: Optional[dict[str, str]]) -> dict[str, Any]:
    """The file's first row, after checking that it is Parquet, has rows and holds the columns the reader takes."""
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
    except Exception as exc:  # truncated, or not Parquet at all
        raise UserError(f"{file}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    names = parquet.schema_arrow.names
    wanted = [ITEM] if columns is None else [columns.get(c, c) for c in REQUIRED_TRANSITION_COLUMNS]
    missing = [c for c in wanted if c not in names]
    if missing:
        hint = ("not episodes in RLlib's format; a table of transitions needs data.columns" if columns is None
                else "data.columns maps RLlib's names to the table's")
        raise UserError(f"{file}: no column {missing[0]!r} ({hint}; columns: {', '.join(names) or 'none'})")
    if parquet.metadata.num_rows == 0:
        raise UserError(f"{file}: holds no rows")
    try:
        batch = next(parquet.iter_batches(batch_size=1, columns=wanted))
        return {name: batch.column(i)[0].as_py() for i, name in enumerate(wanted)}
    except Exception as exc:
        raise UserError(f"{file}: cannot read its first row ({type(exc).__name__}: {exc})") from None


def _check_episode(file: Path, episode: SingleAgentEpisode, spaces: tuple[gym.Space, gym.Space]) -> None:
    for what, recorded, env_space in (("observation", episode.observation_space, spaces[0]),
                                      ("action", episode.action_space, spaces[1])):
        if recorded is not None and not same_kind(recorded, env_space):
            raise UserError(f"{file}: recorded with {what} space {recorded}, the env's is {env_space}")
    if not episode.is_done:
        raise UserError(f"{file}: its first episode is not finished (offline readers take whole episodes only)")
    _check_value(file, "observation", episode.get_observations(0), spaces[0])
    if len(episode):
        _check_value(file, "action", episode.get_actions(0), spaces[1])


def _check_transition(file: Path, row: dict[str, Any], columns: dict[str, str],
                      spaces: tuple[gym.Space, gym.Space]) -> None:
    for name, space in (("obs", spaces[0]), ("new_obs", spaces[0]), ("actions", spaces[1])):
        _check_value(file, f"column {columns.get(name, name)!r}", row[columns.get(name, name)], space)


def _check_value(file: Path, what: str, value: Any, space: gym.Space) -> None:
    """One recorded value against the env's space: the shape a Box holds, an integer a Discrete holds."""
    import numpy as np

    try:
        array = np.asarray(value)
    except Exception:
        array = None
    if isinstance(space, gym.spaces.Box):
        ok = array is not None and array.dtype.kind in "fiub" and array.size == int(np.prod(space.shape))
    elif isinstance(space, gym.spaces.Discrete):
        ok = array is not None and array.size == 1 and array.dtype.kind in "iub" and space.contains(int(array.reshape(())))
    else:  # Dict, Tuple, ...: RLlib's reader judges them
        ok = True
    if not ok:
        shape = "?" if array is None else f"{array.dtype} {list(array.shape)}"
        raise UserError(f"{file}: its first {what} ({shape}) does not fit the env's space {space}")


def same_kind(a: gym.Space, b: gym.Space) -> bool:
    """Two spaces an episode can pass between: the same type, and the same shape (Box) or size (Discrete)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, gym.spaces.Discrete):
        return bool(a.n == b.n)
    return a.shape == b.shape
