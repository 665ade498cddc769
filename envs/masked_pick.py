"""Pick the marked action among the legal ones: a small env for action masking.

Each step some of the `n` actions are legal (each with probability 1/2, at least one) and one legal action is
marked. The observation is a Dict in PettingZoo classic's layout: `observation` (the marked action one-hot, then
the legal actions as 0/1) and `action_mask` (int8, 1 = legal). The marked action earns 1, another legal one 0,
and an illegal one `illegal_reward` and ends the episode. A random masked policy earns about 1/3 per step; one
that reads the observation earns 1 per step, `length` per episode.
"""

from __future__ import annotations

from typing import Any, Optional

import gymnasium as gym
import numpy as np


class MaskedPickEnv(gym.Env):
    def __init__(self, n: int = 6, length: int = 20, illegal_reward: float = -1.0, render_mode: Optional[str] = None):
        if n < 2 or length < 1:
            raise ValueError("n >= 2 and length >= 1 are required")
        self.n, self.length, self.illegal_reward = n, length, float(illegal_reward)
        self.render_mode = render_mode  # nothing to draw
        self.observation_space = gym.spaces.Dict({
            "observation": gym.spaces.Box(0.0, 1.0, shape=(2 * n,), dtype=np.float32),
            "action_mask": gym.spaces.Box(0, 1, shape=(n,), dtype=np.int8),
        })
        self.action_space = gym.spaces.Discrete(n)
        self._mask = np.ones(n, dtype=np.int8)
        self._marked = 0
        self._t = 0

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict[str, Any]] = None):
        super().reset(seed=seed)
        self._t = 0
        return self._draw(), {}

    def step(self, action):
        action = int(action)
        if not self._mask[action]:
            return self._obs(), self.illegal_reward, True, False, {"illegal": True}
        reward = 1.0 if action == self._marked else 0.0
        self._t += 1
        return self._draw(), reward, False, self._t >= self.length, {}

    def _draw(self) -> dict[str, np.ndarray]:
        mask = (self.np_random.random(self.n) < 0.5).astype(np.int8)
        mask[self.np_random.integers(self.n)] = 1
        self._mask = mask
        self._marked = int(self.np_random.choice(np.flatnonzero(mask)))
        return self._obs()

    def _obs(self) -> dict[str, np.ndarray]:
        observation = np.zeros(2 * self.n, dtype=np.float32)
        observation[self._marked] = 1.0
        observation[self.n:] = self._mask
        return {"observation": observation, "action_mask": self._mask.copy()}
