"""Check an env id in the driver, before Ray starts, and turn it into a string every worker can build.

Gymnasium ids are resolved by `gym.make_vec` inside each EnvRunner. An id registered only in
the driver is invisible there, so ids of our `envs` package travel as `envs:rlplatform/...`:
gymnasium imports `envs` in the worker, which registers them.
"""

from __future__ import annotations

import difflib
import importlib

import gymnasium as gym

from rlplatform.errors import UserError

OWN_NAMESPACE = "rlplatform/"
OWN_PACKAGE = "envs"


def runner_env_id(env: str) -> str:
    """Validate `env` and return the id to hand to RLlib's EnvRunners."""
    module, _, env_id = env.rpartition(":")
    if not module and env_id.startswith(OWN_NAMESPACE):
        module = OWN_PACKAGE
    if module:
        _import_env_module(module, env)
    _check_registered(env_id, env)
    return f"{module}:{env_id}" if module else env_id


def _import_env_module(module: str, env: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise UserError(f"env {env!r}: cannot import module {module!r} ({exc})") from None


def _check_registered(env_id: str, env: str) -> None:
    try:
        gym.spec(env_id)
    except gym.error.Error:
        if env_id.startswith("ALE/"):
            raise UserError(f"unknown env id {env!r} (Atari ids need the module prefix: 'ale_py:{env_id}')") from None
        close = difflib.get_close_matches(env_id, list(gym.registry), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"unknown env id {env!r}{hint}") from None
    except ImportError as exc:  # e.g. LunarLander without box2d
        raise UserError(f"env {env!r} needs a package that is not installed: {exc}") from None


def make_env(env: str, /, **kwargs) -> gym.Env:
    """Build one env in this process (evaluation, checks)."""
    return gym.make(runner_env_id(env), **kwargs)
