"""Atari with the standard DQN-style preprocessing, as one Gymnasium env.

`make_atari` is the entry point of `rlplatform/Atari-v0`. It builds the ALE env with
`frameskip=1` (the frame skip is done by AtariPreprocessing, with max-pooling over the last
two frames), then: no-op starts, 84x84 grayscale, observations scaled to [0, 1] (float32),
and the last `frame_stack` frames stacked on the LAST axis -> Box(0, 1, (84, 84, 4)).
Channels-last is what RLlib's default CNN encoder expects ([height, width, channels]).

Keyword arguments not named below go to `gym.make` (ALE options such as
`repeat_action_probability`, `full_action_space`, `render_mode`).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation


class _ChannelsLast(gym.ObservationWrapper):
    """(stack, H, W) -> (H, W, stack)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        space = env.observation_space
        self.observation_space = gym.spaces.Box(
            low=np.moveaxis(space.low, 0, -1),
            high=np.moveaxis(space.high, 0, -1),
            dtype=space.dtype,
        )

    def observation(self, observation):
        return np.moveaxis(np.asarray(observation), 0, -1)


def make_atari(
    game: str = "ALE/Pong-v5",
    frame_stack: int = 4,
    *,
    frame_skip: int = 4,
    screen_size: int = 84,
    noop_max: int = 30,
    terminal_on_life_loss: bool = False,
    **kwargs,
) -> gym.Env:
    import ale_py

    gym.register_envs(ale_py)  # makes the "ALE/..." ids known in this process
    kwargs.pop("frameskip", None)  # the skip is AtariPreprocessing's, never the ALE's
    env = gym.make(game, frameskip=1, **kwargs)
    env = AtariPreprocessing(
        env,
        noop_max=noop_max,
        frame_skip=frame_skip,
        screen_size=screen_size,
        terminal_on_life_loss=terminal_on_life_loss,
        grayscale_obs=True,
        grayscale_newaxis=False,
        scale_obs=True,
    )
    env = FrameStackObservation(env, stack_size=frame_stack)
    return _ChannelsLast(env)
