"""PettingZoo environments, served to RLlib through its ParallelPettingZooEnv wrapper."""

from __future__ import annotations

import importlib


def make_parallel(env_module: str = "mpe2.simple_spread_v3", **kwargs):
    """`env_module`'s `parallel_env(**kwargs)`, wrapped as an RLlib MultiAgentEnv."""
    from ray.rllib.env.wrappers.pettingzoo_env import ParallelPettingZooEnv

    module = importlib.import_module(env_module)
    return ParallelPettingZooEnv(module.parallel_env(**kwargs))
