"""Fault injection for any env, so the platform's fault tolerance can be shown and tested.

`rlplatform/Faulty-v0` wraps the env named in its `env` argument:

    env: rlplatform/Faulty-v0
    env_config: {env: CartPole-v1, env_config: {}, crash_probability: 0.001}

Per step, with `crash_probability` the process dies (`crash_mode: exit`, like a segfault in a
simulator) or the step raises (`crash_mode: raise`); with `hang_probability` the step sleeps
`hang_s` seconds; with `reset_error_probability` a reset raises. Faults fire only inside remote
env runners, never in the process that holds the algorithm, nor in `evaluate` or `envs check`.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import gymnasium as gym
import numpy as np

ALGORITHM_HOST_ENV = "RLPLATFORM_ALGORITHM_HOST"  # rlplatform.run.algorithm_host sets it where the Algorithm lives


def _in_remote_env_runner() -> bool:
    """In a Ray actor (an env runner) that does not hold the algorithm."""
    try:
        import ray
    except ImportError:
        return False
    if not ray.is_initialized() or os.environ.get(ALGORITHM_HOST_ENV):
        return False
    return ray.get_runtime_context().get_actor_id() is not None


class FaultInjection(gym.Wrapper):
    def __init__(self, env: gym.Env, crash_probability: float = 0.0, crash_mode: str = "exit",
                 hang_probability: float = 0.0, hang_s: float = 30.0, reset_error_probability: float = 0.0,
                 seed: Optional[int] = None, active: Optional[bool] = None):
        super().__init__(env)
        for name, p in (("crash_probability", crash_probability), ("hang_probability", hang_probability),
                        ("reset_error_probability", reset_error_probability)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], not {p}")
        if crash_mode not in ("exit", "raise"):
            raise ValueError(f"crash_mode must be 'exit' or 'raise', not {crash_mode!r}")
        self.crash_probability, self.crash_mode = crash_probability, crash_mode
        self.hang_probability, self.hang_s = hang_probability, hang_s
        self.reset_error_probability = reset_error_probability
        self.active = _in_remote_env_runner() if active is None else active
        self._rng = np.random.default_rng(seed)

    def reset(self, **kwargs: Any):
        if self.active and self._rng.random() < self.reset_error_probability:
            raise RuntimeError("injected fault: reset failed")
        return self.env.reset(**kwargs)

    def step(self, action):
        if self.active:
            if self._rng.random() < self.crash_probability:
                if self.crash_mode == "exit":
                    os._exit(17)  # a hard crash: no cleanup, no exception for anybody to catch
                raise RuntimeError("injected fault: step crashed")
            if self._rng.random() < self.hang_probability:
                time.sleep(self.hang_s)
        return self.env.step(action)


def make_faulty(env: str = "CartPole-v1", env_config: Optional[dict[str, Any]] = None, render_mode: Optional[str] = None,
                **faults: Any) -> gym.Env:
    from rlplatform.config.env_ids import make_env

    extra = {"render_mode": render_mode} if render_mode else {}
    return FaultInjection(make_env(env, **(env_config or {}), **extra), **faults)
