"""A small control task whose step burns a configurable amount of real CPU time.

The agent pushes a point mass along a line towards a target. `work_ms` of busy CPU work
per step (and optionally `wait_ms` of sleeping, like an external simulator) make the env
as expensive as a real simulator, so that spreading env runners over cores and nodes
shows a real speed-up.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import gymnasium as gym
import numpy as np


class CostlySimEnv(gym.Env):
    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(self, work_ms: float = 0.0, wait_ms: float = 0.0, render_mode: Optional[str] = None):
        if work_ms < 0 or wait_ms < 0:
            raise ValueError("work_ms and wait_ms must be >= 0")
        self.work_s = work_ms / 1000.0
        self.wait_s = wait_ms / 1000.0
        self.render_mode = render_mode
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(3,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(3)  # push left, coast, push right
        self._pos = self._vel = self._target = 0.0

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict[str, Any]] = None):
        super().reset(seed=seed)
        self._pos = float(self.np_random.uniform(-1.0, 1.0))
        self._vel = 0.0
        self._target = float(self.np_random.uniform(-1.0, 1.0))
        return self._obs(), {}

    def step(self, action):
        self._burn_cpu()
        if self.wait_s:
            time.sleep(self.wait_s)
        self._vel = 0.9 * self._vel + 0.05 * (int(action) - 1)
        self._pos = float(np.clip(self._pos + self._vel, -2.0, 2.0))
        distance = abs(self._pos - self._target)
        reached = distance < 0.05 and abs(self._vel) < 0.05
        reward = 1.0 if reached else -distance * 0.1
        return self._obs(), reward, reached, False, {}

    def render(self):
        if self.render_mode != "rgb_array":
            return None
        frame = np.full((64, 256, 3), 255, dtype=np.uint8)
        to_px = lambda x: int(np.clip((x + 2.0) / 4.0 * 255, 0, 255))  # noqa: E731
        frame[:, to_px(self._target)] = (0, 160, 0)
        frame[24:40, max(0, to_px(self._pos) - 4) : to_px(self._pos) + 4] = (200, 0, 0)
        return frame

    def _obs(self) -> np.ndarray:
        return np.array([self._pos, self._vel, self._target - self._pos], dtype=np.float32)

    def _burn_cpu(self) -> None:
        if not self.work_s:
            return
        deadline = time.thread_time() + self.work_s
        x = 0.0
        while time.thread_time() < deadline:
            for i in range(200):
                x += i * 1e-9
