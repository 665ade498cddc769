"""A replay buffer of transitions in preallocated flat arrays, for the lean off-policy path (DQN and SAC's training step).

RLlib's `EpisodeReplayBuffer` keeps whole episodes and, on every `sample()`, slices one episode per
row, sums its n-step return with `scipy.signal.lfilter`, builds a new `SingleAgentEpisode` per row
and hands the learner a list of episodes for its connector pipeline to turn back into a batch: most
of an off-policy update's cost on a CPU. Here each fragment is cut into n-step transitions once, when
it arrives (observation, action, discounted n-step reward, the observation n steps later, whether
the episode terminated within them, and n), stored in ring arrays of `capacity` transitions, and a
sample is a fancy-index of those arrays: a ready train batch.

The targets are RLlib's (tests/test_lean_off_policy.py compares them row by row): the reward is
sum_k gamma^k r_(t+k) over the next n steps or up to the episode's end, `terminateds` is set where
the episode terminated within them, and `n_step` feeds `gamma ** n_step`. Where fewer than n steps
remain before an episode's end, RLlib's sampler slices past the end, which reads as not terminated,
and bootstraps from the last observation with gamma^n: here those rows are terminated after a
termination, and discounted by the steps actually summed after a time-limit truncation. And a
transition is stored once the n steps after it have arrived: the last n-1 steps of an unfinished
fragment wait for the next fragment of the same episode (RLlib would sample them with a shorter sum).

Prioritized replay (`prioritized=True`) is proportional prioritization (Schaul et al. 2016) on a
sum tree and a min tree, sampled in stratified segments; new transitions get the largest priority
seen so far. Single-agent only: multi-agent experiments keep RLlib's buffers.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

TD_PRIORITY_EPS = 1e-6
_MAX_PENDING = 4096  # tails of unfinished episodes kept waiting for their next fragment


@dataclass
class _Tail:
    """The last steps of an unfinished fragment, whose n-step sums need the next fragment."""

    obs: np.ndarray  # len(actions) + 1 observations
    actions: np.ndarray
    rewards: np.ndarray


class _SegmentTrees:
    """Sum and min over `capacity` leaves, updated and searched for a whole batch of indices at once."""

    def __init__(self, capacity: int) -> None:
        self.leaves = 1 << max(1, int(np.ceil(np.log2(capacity))))
        self.sum = np.zeros(2 * self.leaves)
        self.min = np.full(2 * self.leaves, np.inf)

    def set(self, indices: np.ndarray, values: np.ndarray) -> None:
        nodes = indices + self.leaves
        self.sum[nodes] = values
        self.min[nodes] = values
        while nodes[0] > 1:  # every leaf is at the same depth: the parents of a level, up to the root
            nodes = np.unique(nodes // 2)
            self.sum[nodes] = self.sum[2 * nodes] + self.sum[2 * nodes + 1]
            self.min[nodes] = np.minimum(self.min[2 * nodes], self.min[2 * nodes + 1])

    def total(self) -> float:
        return float(self.sum[1])

    def find(self, masses: np.ndarray) -> np.ndarray:
        """The leaf whose prefix-sum interval holds each mass."""
        nodes = np.ones(len(masses), dtype=np.int64)
        masses = masses.copy()
        while nodes[0] < self.leaves:
            left = 2 * nodes
            go_right = masses >= self.sum[left]
            masses -= np.where(go_right, self.sum[left], 0.0)
            nodes = left + go_right
        return nodes - self.leaves


class FlatReplayBuffer:
    """Transitions in ring arrays; n-step targets computed on insertion; uniform or prioritized sampling."""

    def __init__(
        self,
        capacity: int = 100_000,
        *,
        gamma: float = 0.99,
        n_step: int = 1,
        prioritized: bool = False,
        alpha: float = 0.6,
        beta: float = 0.4,
        seed: Optional[int] = None,
        **_rllib_keys: Any,  # the rest of RLlib's replay_buffer_config (batch_size_B, ...), unused here
    ) -> None:
        if not isinstance(n_step, int) or n_step < 1:
            raise ValueError(f"FlatReplayBuffer needs a whole n_step >= 1, got {n_step!r}")
        self.capacity = int(capacity)
        self.gamma = float(gamma)
        self.n_step = n_step
        self.prioritized = bool(prioritized)
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.rng = np.random.default_rng(seed)
        self.columns: dict[str, np.ndarray] = {}
        self.size = 0
        self.next_index = 0
        self.added = 0
        self.sampled = 0
        self.pending: OrderedDict[str, _Tail] = OrderedDict()
        self.trees = _SegmentTrees(self.capacity) if self.prioritized else None
        self.max_priority = 1.0
        self.last_indices: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return self.size

    # ---- adding ----------------------------------------------------------------------------------
    def add(self, episodes: list) -> None:
        for episode in episodes:
            self.add_fragment(
                episode.id_,
                _single_precision(episode.get_observations()),
                _single_precision(episode.get_actions()),
                np.asarray(episode.get_rewards(), dtype=np.float32),
                terminated=episode.is_terminated,
                done=episode.is_done,
            )

    def add_fragment(
        self, episode_id: str, obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, *, terminated: bool,
        done: bool,
    ) -> None:
        """One fragment of an episode: len(actions) + 1 observations, the first one the step it starts from."""
        tail = self.pending.pop(episode_id, None)
        if tail is not None:
            obs = np.concatenate([tail.obs[:-1], obs])
            actions = np.concatenate([tail.actions, actions])
            rewards = np.concatenate([tail.rewards, rewards])
        length = len(actions)
        ready = length if done else max(0, length - (self.n_step - 1))
        if not done and length > ready:
            self.pending[episode_id] = _Tail(obs[ready:], actions[ready:], rewards[ready:])
            while len(self.pending) > _MAX_PENDING:
                self.pending.popitem(last=False)
        if ready:
            self._store(self._transitions(obs, actions, rewards, ready, terminated and done))

    def _transitions(self, obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, ready: int,
                     terminated: bool) -> dict[str, np.ndarray]:
        length = len(actions)
        starts = np.arange(ready)
        steps = np.minimum(self.n_step, length - starts)  # rewards summed per transition
        padded = np.concatenate([rewards, np.zeros(self.n_step, dtype=np.float64)]).astype(np.float64)
        returns = np.zeros(ready, dtype=np.float64)
        for k in range(self.n_step):
            returns += np.where(k < steps, self.gamma**k * padded[starts + k], 0.0)
        return {
            "obs": obs[:ready],
            "new_obs": obs[starts + steps],
            "actions": actions[:ready],
            "rewards": returns.astype(np.float32),
            "terminateds": (starts + steps == length) & terminated,
            "n_step": steps.astype(np.float32),
        }

    def _store(self, rows: dict[str, np.ndarray]) -> None:
        count = len(rows["rewards"])
        if not self.columns:
            self.columns = {k: np.zeros((self.capacity, *v.shape[1:]), dtype=v.dtype) for k, v in rows.items()}
        if count > self.capacity:  # only the newest fit
            rows = {k: v[-self.capacity:] for k, v in rows.items()}
            count = self.capacity
        indices = (self.next_index + np.arange(count)) % self.capacity
        for key, column in self.columns.items():
            column[indices] = rows[key]
        if self.trees is not None:
            self.trees.set(indices, np.full(count, self.max_priority**self.alpha))
        self.next_index = int((self.next_index + count) % self.capacity)
        self.size = min(self.capacity, self.size + count)
        self.added += count

    # ---- sampling --------------------------------------------------------------------------------
    def sample(self, num_items: int, beta: Optional[float] = None) -> dict[str, np.ndarray]:
        """A train batch of `num_items` rows: the columns RLlib's DQN and SAC losses read, and `weights`."""
        if self.size == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        if self.trees is None:
            indices = self.rng.integers(self.size, size=num_items)
            weights = np.ones(num_items, dtype=np.float32)
        else:
            indices, weights = self._prioritized(num_items, self.beta if beta is None else beta)
        self.last_indices = indices
        self.sampled += num_items
        batch = {key: column[indices] for key, column in self.columns.items()}
        batch["weights"] = weights
        return batch

    def _prioritized(self, num_items: int, beta: float) -> tuple[np.ndarray, np.ndarray]:
        assert self.trees is not None  # called for a prioritized buffer only
        total = self.trees.total()
        masses = (np.arange(num_items) + self.rng.random(num_items)) * (total / num_items)
        indices = np.minimum(self.trees.find(np.minimum(masses, total * (1 - 1e-12))), self.size - 1)
        probabilities = self.trees.sum[indices + self.trees.leaves] / total
        smallest = self.trees.min[1] / total
        weights = (probabilities / smallest) ** -beta  # (N P(i))^-beta / max_j (N P(j))^-beta
        return indices, weights.astype(np.float32)

    def update_priorities(self, td_errors: np.ndarray, indices: Optional[np.ndarray] = None) -> None:
        """Priorities of the rows of the last sample (or of `indices`) from their absolute TD errors."""
        if self.trees is None:
            return
        indices = self.last_indices if indices is None else indices
        if indices is None:
            raise ValueError("update_priorities: no indices given and no sample drawn yet")
        priorities = np.abs(np.asarray(td_errors, dtype=np.float64)) + TD_PRIORITY_EPS
        self.max_priority = max(self.max_priority, float(priorities.max()))
        # One row drawn twice keeps its last priority, as sequential updates would.
        self.trees.set(indices, priorities**self.alpha)

    # ---- checkpoints and metrics -----------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        state = {k: getattr(self, k) for k in ("size", "next_index", "added", "sampled", "max_priority")}
        state["columns"] = {k: v[: self.size].copy() if self.size < self.capacity else v
                            for k, v in self.columns.items()}
        state["pending"] = dict(self.pending)
        state["rng"] = self.rng.bit_generator.state
        if self.trees is not None:
            state["priorities"] = self.trees.sum[self.trees.leaves: self.trees.leaves + self.size].copy()
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        self.size, self.next_index = state["size"], state["next_index"]
        self.added, self.sampled, self.max_priority = state["added"], state["sampled"], state["max_priority"]
        self.columns = {}
        for key, values in state["columns"].items():
            column = np.zeros((self.capacity, *values.shape[1:]), dtype=values.dtype)
            kept = min(len(values), self.capacity)
            column[:kept] = values[:kept]
            self.columns[key] = column
        self.pending = OrderedDict(state["pending"])
        self.rng.bit_generator.state = state["rng"]
        if self.trees is not None and self.size:
            self.trees.set(np.arange(self.size), state["priorities"][: self.size])

    def get_metrics(self) -> dict[str, Any]:
        return {"num_env_steps_stored": self.size, "num_env_steps_added_lifetime": self.added,
                "num_env_steps_sampled_lifetime": self.sampled}


def _single_precision(values) -> np.ndarray:
    """float64 as float32, as RLlib's learner connector hands them to torch (MuJoCo's observations are float64):
    the module's weights are float32, and the buffer holds half the bytes."""
    array = np.asarray(values)
    return array.astype(np.float32) if array.dtype == np.float64 else array
