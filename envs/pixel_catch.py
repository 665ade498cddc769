"""Catch from pixels: a ball falls, the agent moves a paddle to catch it.

Observations are `size` x `size` grayscale images scaled to [0, 1] (float32, which RLlib's
default CNN takes as they are), the last `frame_stack` frames stacked as channels, so CNN models
and frame stacking are exercised on a CPU without Atari.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Optional

import gymnasium as gym
import numpy as np


class PixelCatchEnv(gym.Env):
    metadata = {"render_modes": ["rgb_array"], "render_fps": 15}

    def __init__(self, size: int = 64, frame_stack: int = 4, paddle_width: int = 12, render_mode: Optional[str] = None):
        if size < 16 or frame_stack < 1 or not 2 <= paddle_width < size:
            raise ValueError("size >= 16, frame_stack >= 1 and 2 <= paddle_width < size are required")
        self.size, self.frame_stack, self.paddle_width = size, frame_stack, paddle_width
        self.render_mode = render_mode
        self.observation_space = gym.spaces.Box(0.0, 1.0, shape=(size, size, frame_stack), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(3)  # left, stay, right
        self._frames: deque[np.ndarray] = deque(maxlen=frame_stack)
        self._ball = np.zeros(2, dtype=np.int64)  # row, column
        self._paddle = 0
        self._speed = 4

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict[str, Any]] = None):
        super().reset(seed=seed)
        self._ball = np.array([0, self.np_random.integers(0, self.size)])
        self._paddle = int(self.np_random.integers(0, self.size - self.paddle_width))
        frame = self._draw()
        for _ in range(self.frame_stack):
            self._frames.append(frame)
        return self._obs(), {}

    def step(self, action):
        self._paddle = int(np.clip(self._paddle + (int(action) - 1) * 3, 0, self.size - self.paddle_width))
        self._ball[0] += self._speed
        done = self._ball[0] >= self.size - 2
        reward = 0.0
        if done:
            caught = self._paddle <= self._ball[1] < self._paddle + self.paddle_width
            reward = 1.0 if caught else -1.0
        self._frames.append(self._draw())
        return self._obs(), reward, bool(done), False, {}

    def render(self):
        if self.render_mode == "rgb_array":
            return np.repeat(self._draw()[:, :, None], 3, axis=2)  # uint8 RGB for video
        return None

    def _draw(self) -> np.ndarray:
        frame = np.zeros((self.size, self.size), dtype=np.uint8)
        row, col = min(int(self._ball[0]), self.size - 3), int(self._ball[1])
        frame[row : row + 2, max(0, col - 1) : col + 1] = 255
        frame[self.size - 2 :, self._paddle : self._paddle + self.paddle_width] = 160
        return frame

    def _obs(self) -> np.ndarray:
        return np.stack(self._frames, axis=-1).astype(np.float32) / 255.0
