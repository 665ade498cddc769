"""Whole episodes of a real Gymnasium env, built with RLlib's episode API as its env runner builds them (no Ray)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import gymnasium as gym
import numpy as np


def play(env_id: str, count: int, policy: Optional[Callable[[np.ndarray], Any]] = None, seed: int = 0) -> list:
    """`count` finished episodes; `policy(observation) -> action`, uniform random actions where None. A Box action
    is kept as RLlib's env runner keeps it, in the module's space ([-1, 1] for a bounded Box)."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    from rlplatform.adapter.offline_data import module_action

    env = gym.make(env_id)
    env.action_space.seed(seed)
    episodes = []
    for i in range(count):
        obs, info = env.reset(seed=seed + i)
        episode = SingleAgentEpisode(observation_space=env.observation_space, action_space=env.action_space)
        episode.add_env_reset(observation=obs, infos=info)
        done = False
        while not done:
            action = env.action_space.sample() if policy is None else policy(obs)
            obs, reward, terminated, truncated, info = env.step(action)
            episode.add_env_step(observation=obs, action=module_action(action, env.action_space), reward=reward, infos=info, terminated=terminated,
                                 truncated=truncated, extra_model_outputs={"action_logp": np.float32(-0.69)})
            done = terminated or truncated
        episodes.append(episode)
    env.close()
    return episodes


def cartpole_expert(obs: np.ndarray) -> int:
    """Push towards the side the pole falls to: a linear rule that holds CartPole-v1 for all 500 steps."""
    return int(obs[2] + 0.5 * obs[3] > 0)
