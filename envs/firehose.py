"""The cheapest env we have: a step costs almost nothing, so a run on it measures the pipeline.

`rlplatform/Firehose-v0` is for measuring the platform's own cost per env step (env runners,
connectors, transport, learners): whatever a run on it spends, the env did not. Each episode is
`episode_len` steps, then `truncated=True` (the env truncates itself: registered without
`max_episode_steps`). Observations come from a ring of 64 arrays drawn at `reset(seed=...)`,
float32 in [-1, 1] of shape `(obs_size,)`; a step hands out a fresh copy of the next one (so a
consumer that writes into it cannot corrupt the ring). The action is Discrete(2); the reward is
1.0 when the action equals the target bit the observation shows (`obs[0] > 0` means 1), else 0.0:
a policy can learn it, so a learning curve on it is a sanity check too.

Cost per step, measured with timeit over 1e6 steps (3 repeats, best) on the development machine
(2-core VM, Python 3.11): about 0.45 us for `step()` on the bare env (the same at `obs_size` 4
and 64), about 0.7 us through `gymnasium.make` (its order-enforcing and checker wrappers). Anything
a run spends beyond that per env step is the pipeline's.
"""

from __future__ import annotations

from typing import Any, Optional

import gymnasium as gym
import numpy as np

RING = 64


class FirehoseEnv(gym.Env):
    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, episode_len: int = 100, obs_size: int = 4):
        if isinstance(episode_len, bool) or not isinstance(episode_len, (int, np.integer)) or episode_len < 1:
            raise ValueError(f"episode_len must be an integer >= 1, got {episode_len!r}")
        if isinstance(obs_size, bool) or not isinstance(obs_size, (int, np.integer)) or obs_size < 1:
            raise ValueError(f"obs_size must be an integer >= 1, got {obs_size!r}")
        self.episode_len = int(episode_len)
        self.obs_size = int(obs_size)
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(self.obs_size,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self._ring = np.empty((0, self.obs_size), dtype=np.float32)  # drawn at the first reset
        self._targets: list[int] = []
        self._i = 0
        self._t = 0

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict[str, Any]] = None):
        super().reset(seed=seed)
        if seed is not None or not len(self._ring):
            self._ring = self.np_random.uniform(-1.0, 1.0, size=(RING, self.obs_size)).astype(np.float32)
            self._targets = [int(x > 0) for x in self._ring[:, 0]]
        self._i = int(self.np_random.integers(RING))
        self._t = 0
        return self._ring[self._i].copy(), {}

    def step(self, action):
        reward = 1.0 if action == self._targets[self._i] else 0.0
        self._t += 1
        self._i = (self._i + 1) % RING
        return self._ring[self._i].copy(), reward, False, self._t >= self.episode_len, {}
