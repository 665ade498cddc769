"""A fragment's env steps kept as [step, env] arrays and cut into RLlib episodes once, at the fragment's end.

RLlib's SingleAgentEnvRunner adds every env step to its sub-env's episode object, one sub-env at a
time (`add_env_step`, with a dict of extra model outputs per step), turns every finished episode's
lists into arrays (`to_numpy`) and cuts the ongoing ones at the end of the fragment (`cut`). On a cheap
env that bookkeeping cost more than the env: py-spy on a CartPole runner with 32 envs, 17 % of the
runner in the per-sub-env loop against 28 % in the vector env's step.

Here a vector step appends its batch arrays to lists (a few appends per step, whatever the number of
envs). At the fragment's end they are stacked once, laid out env by env, and every episode, finished
or cut, is built by RLlib's SingleAgentEpisode constructor from contiguous views into those arrays:
the same ids across fragments, lookback, values, dtypes, start and step times as RLlib's
`add_env_reset`/`add_env_step` + `to_numpy` + `cut` give (tests/test_columnar_fragment.py compares
them field by field against the per-step path).

What it assumes (checked by `columnar_applies` in lean_env_runner.py): gymnasium's NEXT_STEP autoreset
(the step after a sub-env's last one resets it, its action ignored, its reward not counted), RLlib's
lookback of one step, and no episode callbacks except ones that may run at the fragment's end
(`runs_at_fragment_end`); on_episode_end then sees the finished episode as arrays, not lists, and its earlier
chunks (`prev_episode_chunks`) with their id, length, rewards and times only (`metrics_shell`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import gymnasium as gym
import numpy as np
from ray.rllib.env.single_agent_episode import _REWARDS_BOX_SPACE as REWARDS_SPACE  # the rewards buffers' space
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer
from ray.rllib.utils.spaces.space_utils import get_base_struct_from_space

from rlplatform.internals.episode_transport import PackedEpisodes

AT_FRAGMENT_END = "rlplatform_runs_at_fragment_end"


def runs_at_fragment_end(callback: Callable[..., Any]) -> Callable[..., Any]:
    """Mark an on_episode_end callback that may run when the fragment ends instead of at the episode's last step."""
    setattr(callback, AT_FRAGMENT_END, True)
    return callback


@dataclass
class EnvSlot:
    """One sub-env's episode, carried from one fragment to the next."""

    id_: str
    t: int = 0  # env steps the episode had before this fragment (0: a fresh episode, no lookback)
    start_time: Optional[float] = None  # the reset's time; None once a chunk was returned (a chunk starts at its first step)
    resets_first: bool = False  # its episode ended on the last step: this fragment's first step resets it


@dataclass
class Carry:
    """The previous fragment's last step (the lookback of the episodes it cut)."""

    obs: np.ndarray  # the observation the last actions were computed from
    infos: list
    actions: np.ndarray
    rewards: np.ndarray
    extras: dict[str, np.ndarray]


@dataclass
class Rows:
    obs: list = field(default_factory=list)  # obs[0]: the fragment's first observations; obs[r + 1]: after step r
    infos: list = field(default_factory=list)
    actions: list = field(default_factory=list)
    rewards: list = field(default_factory=list)
    terminateds: list = field(default_factory=list)
    truncateds: list = field(default_factory=list)
    extras: dict[str, list] = field(default_factory=dict)
    times: list = field(default_factory=list)


class ColumnarFragments:
    """Fragments of a vector env's steps, and the RLlib episodes they make."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space):
        self.observation_space, self.action_space = observation_space, action_space
        self.slots: list[EnvSlot] = []
        self.carry: Optional[Carry] = None
        self.next_obs: Optional[np.ndarray] = None
        self.next_infos: list = []
        self.rows = Rows()
        self._resetting = np.zeros(0, dtype=bool)

    def start(self, episodes: list[SingleAgentEpisode]) -> None:
        """After a reset of all sub-envs: RLlib's fresh episodes, each holding its first observation."""
        self.slots = [EnvSlot(e.id_, start_time=e._start_time) for e in episodes]
        self.carry = None
        self.next_obs = np.stack([e.get_observations(-1) for e in episodes])
        self.next_infos = [e.get_infos(-1) for e in episodes]
        self._resetting = np.zeros(len(episodes), dtype=bool)
        self.rows = Rows()

    def begin(self) -> None:
        self.rows = Rows(obs=[self.next_obs], infos=[self.next_infos])
        self._resetting = np.array([slot.resets_first for slot in self.slots], dtype=bool)

    def add(self, actions: np.ndarray, extras: dict[str, np.ndarray], observations: np.ndarray, rewards: np.ndarray,
            terminateds: np.ndarray, truncateds: np.ndarray, infos: list) -> int:
        """One vector step; returns the env steps it counts (sub-envs being reset count none)."""
        rows = self.rows
        rows.times.append(time.perf_counter())
        rows.actions.append(actions)
        for key, value in extras.items():
            rows.extras.setdefault(key, []).append(value)
        rows.obs.append(observations)
        rows.infos.append(infos)
        rows.rewards.append(rewards)
        rows.terminateds.append(terminateds)
        rows.truncateds.append(truncateds)
        counted = len(actions) - int(self._resetting.sum())
        self._resetting = terminateds | truncateds
        self.next_obs, self.next_infos = observations, infos
        return counted

    def finish(self, constant_extras: dict[str, Any]) -> tuple[list[tuple[int, SingleAgentEpisode]], "FragmentEpisodes"]:
        """The finished episodes (with their sub-env's index, in the order they ended) and every episode of the
        fragment, finished ones first, then the cut chunks of the ongoing ones in sub-env order (none for a
        sub-env without a step yet), as RLlib's `_sample` returns them; the slots move on."""
        rows = self.rows
        steps = len(rows.actions)
        if steps == 0:
            return [], FragmentEpisodes([], None, [])
        columns = self._columns(constant_extras)
        done = np.logical_or(columns.terminateds, columns.truncateds)
        finished: list[tuple[int, int, Cut]] = []
        chunks: list[Cut] = []
        for i, slot in enumerate(self.slots):
            first = 0
            if slot.resets_first:  # a fresh episode (its id drawn when the last one ended) starts after row 0's reset
                slot.t, slot.start_time, slot.resets_first = 0, rows.times[0], False
                first = 1
            for last in np.flatnonzero(done[:, i]).tolist():
                if last < first:  # the reset step of a sub-env that ended on the previous step
                    continue
                finished.append((last, i, self._cut(columns, i, slot, first, last)))
                first = last + 2
                slot.id_, slot.t = uuid.uuid4().hex, 0
                slot.start_time = rows.times[first - 1] if first - 1 < steps else None  # the reset's time
                slot.resets_first = first - 1 >= steps  # ended on the last step: the next fragment's first resets it
            if first < steps:
                chunks.append(self._cut(columns, i, slot, first, steps - 1))
                slot.t += steps - first
            # RLlib's `cut` leaves the continuation without a start time: its next chunk's clock starts at its first
            # step (or, for `resets_first`, at the reset).
            slot.start_time = None
        self.carry = Carry(obs=rows.obs[-2], infos=rows.infos[-2], actions=rows.actions[-1], rewards=rows.rewards[-1],
                           extras=columns.extras_last)
        self.rows = Rows()
        finished.sort(key=lambda item: (item[0], item[1]))
        cuts = [cut for _, _, cut in finished] + chunks
        episodes = FragmentEpisodes(episodes_from_columns(columns.shipped, cuts), columns.shipped, cuts)
        return [(i, episode) for (_, i, _), episode in zip(finished, episodes)], episodes

    def _columns(self, constant_extras: dict[str, Any]) -> "_Columns":
        """The fragment's arrays env by env, each with the carried step in front (row 0), so that an episode's
        steps, lookback included, are one contiguous slice."""
        rows, carry = self.rows, self.carry
        steps = len(rows.actions)
        extra_rows = dict(rows.extras)
        for key, value in constant_extras.items():
            extra_rows[key] = [np.full(len(self.slots), value)] * steps
        if carry is None:  # right after a reset: no episode has a lookback, the front row is never read
            carry = Carry(obs=rows.obs[0], infos=rows.infos[0], actions=rows.actions[0], rewards=rows.rewards[0],
                          extras={k: v[0] for k, v in extra_rows.items()})
        shipped = ShippedColumns(
            obs=_by_env([carry.obs, *rows.obs]), infos=[carry.infos, *rows.infos],
            actions=_by_env([carry.actions, *rows.actions]), rewards=_by_env([carry.rewards, *rows.rewards]),
            # A key the carried step lacks (a module whose exploring and greedy outputs differ, switched between
            # fragments) gets zeros in the carried row; RLlib's per-step path would start its buffer there instead.
            extras={k: _by_env([carry.extras.get(k, np.zeros_like(v[0])), *v]) for k, v in extra_rows.items()},
            observation_space=self.observation_space, action_space=self.action_space)
        return _Columns(shipped=shipped, terminateds=np.stack(rows.terminateds), truncateds=np.stack(rows.truncateds),
                        times=rows.times, extras_last={k: v[-1] for k, v in extra_rows.items()})

    def _cut(self, columns: "_Columns", i: int, slot: EnvSlot, first: int, last: int) -> "Cut":
        """Where sub-env i's episode lies: from its first observation row `first` to its last step `last` (this
        fragment's rows), with the carried step as lookback where it continues an episode of an earlier fragment."""
        lookback = 1 if first == 0 and slot.t > 0 else 0
        return Cut(env=i, lo=first + 1 - lookback, steps=last - first + 1, lookback=lookback, id_=slot.id_, t_started=slot.t,
                   terminated=columns.terminateds[last, i], truncated=columns.truncateds[last, i],  # numpy bools, as RLlib stores
                   start_time=slot.start_time if slot.start_time is not None else columns.times[first],
                   last_step_time=columns.times[last])


class Cut(NamedTuple):
    """One episode's place in a fragment's columns (rows counted with the carried row in front)."""

    env: int
    lo: int  # its first row, lookback included
    steps: int  # its env steps in this fragment (after the lookback)
    lookback: int
    id_: str
    t_started: int
    terminated: Any
    truncated: Any
    start_time: float
    last_step_time: float


@dataclass
class ShippedColumns:
    """What a fragment's episodes are made of, env by env: [env, row, ...] arrays, infos as [row][env]."""

    obs: np.ndarray  # rows: the carried one, the fragment's first observations, one per step
    infos: list
    actions: np.ndarray  # rows: the carried one, one per step
    rewards: np.ndarray
    extras: dict[str, np.ndarray]
    observation_space: gym.Space
    action_space: gym.Space


@dataclass
class _Columns:
    shipped: ShippedColumns
    terminateds: np.ndarray  # [rows, env]
    truncateds: np.ndarray
    times: list
    extras_last: dict[str, np.ndarray]


class FragmentEpisodes(list):
    """A columnar runner's episodes; pickled as the fragment's columns and each episode's place in them (a few
    arrays and a list of tuples), and rebuilt from those on the other side."""

    def __init__(self, episodes: list, columns: Optional[ShippedColumns], cuts: list[Cut]):
        super().__init__(episodes)
        self._columns, self._cuts, self._built = columns, cuts, tuple(episodes)

    def __reduce__(self):
        if self._columns is None or not self._unchanged():  # pickle what it holds now, packed
            return PackedEpisodes(self).__reduce__()
        return episodes_from_columns, (self._columns, self._cuts)

    def _unchanged(self) -> bool:
        """The same episodes, in the same order, none with custom data (what the columns cannot carry)."""
        return (len(self) == len(self._built) and all(a is b for a, b in zip(self, self._built))
                and not any(episode.custom_data for episode in self))


def episodes_from_columns(columns: ShippedColumns, cuts: list[Cut]) -> list[SingleAgentEpisode]:
    """The episodes the cuts describe, as RLlib's per-step path and `to_numpy` leave them: their arrays are views
    into the columns. Built attribute by attribute (RLlib's constructor works out each buffer's space structure
    again, 14 % of a CartPole runner's time)."""
    obs_space, act_space = columns.observation_space, columns.action_space
    obs_struct, act_struct = get_base_struct_from_space(obs_space), get_base_struct_from_space(act_space)
    rewards_struct = get_base_struct_from_space(REWARDS_SPACE)
    episodes = []
    for cut in cuts:
        i, lo, lookback = cut.env, cut.lo, cut.lookback
        step_hi = lo + lookback + cut.steps
        obs_hi = step_hi + 1
        infos = [row[i] for row in columns.infos[lo:obs_hi]]
        episode = SingleAgentEpisode.__new__(SingleAgentEpisode)
        episode.id_ = cut.id_
        episode.agent_id = episode.module_id = episode.multi_agent_episode_id = None
        episode.observations = _buffer(columns.obs[i, lo:obs_hi], lookback, obs_space, obs_struct)
        episode.infos = _buffer(infos, lookback, None, None)
        episode.actions = _buffer(columns.actions[i, lo:step_hi], lookback, act_space, act_struct)
        episode.rewards = _buffer(columns.rewards[i, lo:step_hi], lookback, REWARDS_SPACE, rewards_struct)
        episode.extra_model_outputs = {k: _buffer(v[i, lo:step_hi], lookback, None, None) for k, v in columns.extras.items()}
        episode._observation_space, episode._action_space = obs_space, act_space
        episode.is_terminated, episode.is_truncated = cut.terminated, cut.truncated
        episode.t_started = cut.t_started
        episode.t = cut.t_started + cut.steps
        episode._custom_data = {}
        # What add_env_reset/add_env_step record as they go (RLlib's episode metrics read the times).
        episode._start_time, episode._last_step_time = cut.start_time, cut.last_step_time
        episode._last_added_observation = columns.obs[i, obs_hi - 1]
        episode._last_added_infos = infos[-1]
        episodes.append(episode)
    return episodes


def metrics_shell(episode: SingleAgentEpisode) -> SingleAgentEpisode:
    """What RLlib's episode metrics read of a chunk it keeps until its episode ends (`len`, `get_return`,
    `get_duration_s`, the id), with a copy of its rewards: the chunk itself is a view into its whole fragment's
    arrays, which keeping it would keep alive for every sub-env."""
    shell = SingleAgentEpisode.__new__(SingleAgentEpisode)
    shell.id_, shell.t_started, shell.t = episode.id_, episode.t_started, episode.t
    shell.agent_id = shell.module_id = shell.multi_agent_episode_id = None
    shell.is_terminated, shell.is_truncated = episode.is_terminated, episode.is_truncated
    rewards = episode.rewards
    shell.rewards = _buffer(np.array(rewards.data), rewards.lookback, rewards.space, rewards.space_struct)
    shell.observations = shell.infos = shell.actions = None
    shell.extra_model_outputs = {}
    shell._observation_space, shell._action_space = episode.observation_space, episode.action_space
    shell._start_time, shell._last_step_time = episode._start_time, episode._last_step_time
    shell._last_added_observation = shell._last_added_infos = None
    shell._custom_data = {}
    return shell


def _buffer(data: Any, lookback: int, space: Optional[gym.Space], struct: Any) -> InfiniteLookbackBuffer:
    """InfiniteLookbackBuffer(data, lookback, space), with the space's structure worked out once per fragment."""
    buffer = InfiniteLookbackBuffer.__new__(InfiniteLookbackBuffer)
    buffer.data, buffer.lookback, buffer.finalized = data, lookback, not isinstance(data, list)
    buffer._space, buffer._space_struct = space, struct
    return buffer


def _by_env(rows: list) -> np.ndarray:
    """[env, row, ...] from a list of [env, ...] rows, in one copy."""
    return np.stack(rows, axis=1)
