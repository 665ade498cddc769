"""Pursuit/evasion on a small grid: a multi-agent env on RLlib's MultiAgentEnv.

`num_pursuers` pursuers (`pursuer_0`, ...) chase one evader (`evader_0`) on a `size` x `size`
grid. The episode ends when a pursuer steps onto the evader (pursuers +1, evader -1) or after
`max_steps` (evader +1). Every agent sees its own position and everybody else's, scaled to [0, 1].
"""

from __future__ import annotations

from typing import Any, Optional

import gymnasium as gym
import numpy as np
from ray.rllib.env.multi_agent_env import MultiAgentEnv

MOVES = np.array([[0, 0], [1, 0], [-1, 0], [0, 1], [0, -1]])  # stay, down, up, right, left


class PursuitEnv(MultiAgentEnv):
    def __init__(self, size: int = 6, num_pursuers: int = 2, max_steps: int = 40, config: Optional[dict] = None):
        super().__init__()
        if size < 3 or num_pursuers < 1 or max_steps < 1:
            raise ValueError("size >= 3, num_pursuers >= 1 and max_steps >= 1 are required")
        self.size, self.max_steps = size, max_steps
        self.pursuers = [f"pursuer_{i}" for i in range(num_pursuers)]
        self.possible_agents = [*self.pursuers, "evader_0"]
        self.agents = list(self.possible_agents)
        obs_space = gym.spaces.Box(0.0, 1.0, shape=(2 * len(self.possible_agents),), dtype=np.float32)
        self.observation_spaces = {a: obs_space for a in self.possible_agents}
        self.action_spaces = {a: gym.spaces.Discrete(len(MOVES)) for a in self.possible_agents}
        self._positions: dict[str, np.ndarray] = {}
        self._t = 0
        self._rng = np.random.default_rng()

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict[str, Any]] = None):
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._t = 0
        cells = self._rng.choice(self.size * self.size, size=len(self.possible_agents), replace=False)
        self._positions = {a: np.array(divmod(int(c), self.size)) for a, c in zip(self.possible_agents, cells)}
        return self._observations(), {}

    def step(self, action_dict: dict[str, int]):
        self._t += 1
        for agent, action in action_dict.items():
            self._positions[agent] = np.clip(self._positions[agent] + MOVES[int(action)], 0, self.size - 1)
        caught = any((self._positions[p] == self._positions["evader_0"]).all() for p in self.pursuers)
        timeout = self._t >= self.max_steps
        if caught:
            rewards = {**{p: 1.0 for p in self.pursuers}, "evader_0": -1.0}
        else:
            distance = min(np.abs(self._positions[p] - self._positions["evader_0"]).sum() for p in self.pursuers)
            shaping = 0.01 * distance / (2 * self.size)
            rewards = {**{p: -shaping for p in self.pursuers}, "evader_0": shaping + (1.0 if timeout else 0.0)}
        terminateds = {"__all__": caught}
        truncateds = {"__all__": timeout and not caught}
        return self._observations(), rewards, terminateds, truncateds, {}

    def _observations(self) -> dict[str, np.ndarray]:
        flat = np.concatenate([self._positions[a] for a in self.possible_agents]).astype(np.float32) / (self.size - 1)
        return {a: flat.copy() for a in self.possible_agents}
