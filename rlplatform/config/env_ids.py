"""Check an env id in the driver, before Ray starts, and turn it into a string every worker can build.

Gymnasium ids are resolved by `gym.make_vec` inside each EnvRunner. An id registered only in
the driver is invisible there, so ids of our envs (the project's `envs/` folder, installed as the
package `rlplatform_envs`) travel as `rlplatform_envs:rlplatform/...`: gymnasium imports that
package in the worker, which registers them.
"""

from __future__ import annotations

import importlib
from typing import Any

import gymnasium as gym

from rlplatform.errors import UserError, did_you_mean

OWN_NAMESPACE = "rlplatform/"
OWN_PACKAGE = "rlplatform_envs"
LEGACY_PACKAGES = ("envs",)  # the import name of our envs before they were installed as rlplatform_envs


def runner_env_id(env: str) -> str:
    """Validate `env` and return the id to hand to RLlib's EnvRunners."""
    module, _, env_id = env.rpartition(":")
    if (not module or module in LEGACY_PACKAGES) and env_id.startswith(OWN_NAMESPACE):
        module = OWN_PACKAGE
    if module:
        _import_env_module(module, env)
    elif env_id.startswith("ALE/"):
        # Registered here only if this process imported ale_py already; an env runner's fresh process has not.
        raise UserError(f"unknown env id {env!r} (Atari ids need the module prefix: 'ale_py:{env_id}')")
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
        raise UserError(f"unknown env id {env!r}{did_you_mean(env_id, gym.registry)}") from None
    except ImportError as exc:  # e.g. LunarLander without box2d
        raise UserError(f"env {env!r} needs a package that is not installed: {exc}") from None


def make_env(env: str, /, **kwargs: Any) -> gym.Env:
    """Build one env in this process (evaluation, checks)."""
    return gym.make(runner_env_id(env), **kwargs)
