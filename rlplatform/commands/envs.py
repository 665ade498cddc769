"""`rlplatform envs list` and `rlplatform envs check ENV_ID`: what can be trained, and is it sound.

`check` runs Gymnasium's env checker (RLlib's for multi-agent envs), checks that one seed gives
the same first observations twice, measures raw steps/s in this process, and builds the env
inside a real remote Ray env runner. One line per check; exit 1 if any failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from typing import Any, Callable

import numpy as np
from rich.markup import escape

from rlplatform import console
from rlplatform.config.files import load_yaml_text
from rlplatform.config.schema import validate
from rlplatform.errors import UserError

SUITES = {  # suite -> (module that must import, how to recognise its ids)
    "classic control": ("gymnasium", lambda spec: "classic_control" in str(spec.entry_point)),
    "toy text": ("gymnasium", lambda spec: "toy_text" in str(spec.entry_point)),
    "box2d": ("Box2D", lambda spec: "box2d" in str(spec.entry_point)),
    "mujoco": ("mujoco", lambda spec: "mujoco" in str(spec.entry_point)),
    "atari (ale_py:ALE/...)": ("ale_py", lambda spec: spec.id.startswith("ALE/")),
}


def add_parser(subparsers: Any) -> None:  # argparse's sub-parsers action
    p = subparsers.add_parser("envs", help="list environments, or check one")
    verbs = p.add_subparsers(dest="envs_verb", metavar="list|check", required=True)
    verbs.add_parser("list", help="our envs and the installed suites' ids").set_defaults(func=run_list)
    check = verbs.add_parser("check", help="check an env: gymnasium checker, determinism, steps/s, remote build")
    check.add_argument("env_id")
    check.add_argument("--env-config", default="{}", help="YAML mapping of constructor arguments, e.g. '{work_ms: 1}'")
    check.add_argument("--steps", type=int, default=2000, help="random steps for the steps/s measurement")
    check.add_argument("--address", help="build the remote env runner on this Ray cluster (default: a private local instance)")
    check.add_argument("--no-ray", action="store_true", help="skip the remote env runner check")
    check.set_defaults(func=run_check)


def run_list(args: argparse.Namespace) -> int:
    import gymnasium as gym

    import rlplatform_envs

    console.stdout.print("[bold]rlplatform envs[/] (envs/)")
    for env_id, (entry_point, _, multi_agent) in rlplatform_envs.ENVS.items():
        console.say(f"  {env_id:<36} {'multi-agent' if multi_agent else 'single-agent'}  {entry_point}")
    if importlib.util.find_spec("ale_py"):
        import ale_py

        gym.register_envs(ale_py)
    for suite, (module, belongs) in SUITES.items():
        installed = importlib.util.find_spec(module) is not None
        ids = sorted(spec.id for spec in gym.registry.values() if belongs(spec)) if installed else []
        status = f"{len(ids)} ids" if installed else "not installed"
        console.stdout.print(f"[bold]{suite}[/]: {status}")
        if ids:
            console.say("  " + ", ".join(ids[:12]) + (f", ... ({len(ids) - 12} more)" if len(ids) > 12 else ""))
    return 0


def _env_config(text: str) -> dict[str, Any]:
    try:
        value = load_yaml_text(text)
    except Exception:
        raise UserError(f"--env-config is not valid YAML: {text!r}") from None
    if not isinstance(value, dict):
        raise UserError(f"--env-config must be a mapping, e.g. '{{work_ms: 1}}', not {text!r}")
    return value


def run_check(args: argparse.Namespace) -> int:
    from rlplatform.adapter.algorithm_config import is_multi_agent_env
    from rlplatform.config.env_ids import make_env, runner_env_id

    runner_env_id(args.env_id)  # unknown ids end here, as a usage error
    env_config = _env_config(args.env_config)
    multi_agent = is_multi_agent_env(args.env_id)
    try:
        make_env(args.env_id, **env_config).close()
    except Exception as exc:
        raise UserError(f"env {args.env_id!r} cannot be built with {env_config}: {type(exc).__name__}: {exc}") from None
    checks: list[tuple[str, Callable[[], str]]] = [
        ("env checker", lambda: _checker(args.env_id, env_config, multi_agent)),
        ("same seed, same first observations", lambda: _determinism(args.env_id, env_config, multi_agent)),
        ("raw steps/s (random actions, this process)", lambda: _steps_per_second(args.env_id, env_config, multi_agent, args.steps)),
    ]
    if not args.no_ray:
        checks.append(("builds in a remote Ray env runner", lambda: _remote(args.env_id, env_config, multi_agent, args.address)))
    failed = 0
    for name, check in checks:
        try:
            detail = check()
            console.stdout.print(f"[green]ok[/]   {escape(f'{name}: {detail}')}")
        except Exception as exc:  # each check reports its own failure and the others still run
            failed += 1
            console.stdout.print(f"[red]FAIL[/] {escape(f'{name}: {type(exc).__name__}: {_last_line(exc)}')}")
    console.say(f"{args.env_id}: {len(checks) - failed}/{len(checks)} checks passed")
    return 1 if failed else 0


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1] if text else ""


def _checker(env_id: str, env_config: dict, multi_agent: bool) -> str:
    from rlplatform.config.env_ids import make_env

    env = make_env(env_id, **env_config)
    try:
        if multi_agent:
            from rlplatform.adapter.env_runners import check_multi_agent_env

            check_multi_agent_env(env.unwrapped)
            return "RLlib's multi-agent checks passed"
        from gymnasium.utils.env_checker import check_env

        check_env(env.unwrapped, skip_render_check=True)
        return "gymnasium's check_env passed"
    finally:
        env.close()


def _rollout(env_id: str, env_config: dict, multi_agent: bool, seed: int, steps: int) -> list:
    from rlplatform.config.env_ids import make_env

    env = make_env(env_id, **env_config)
    try:
        obs, _ = env.reset(seed=seed)
        seen = [obs]
        spaces: dict[Any, Any] = {}
        if not multi_agent:
            env.action_space.seed(seed)
        for _ in range(steps):
            if multi_agent:
                for agent in obs:
                    if agent not in spaces:
                        spaces[agent] = env.unwrapped.get_action_space(agent)
                        spaces[agent].seed(seed)
                action = {agent: spaces[agent].sample() for agent in obs}
                obs, _, term, trunc, _ = env.step(action)
                done = term.get("__all__") or trunc.get("__all__")
            else:
                obs, _, term, trunc, _ = env.step(env.action_space.sample())
                done = term or trunc
            seen.append(obs)
            if done:
                obs, _ = env.reset()
        return seen
    finally:
        env.close()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return np.array_equal(np.asarray(a), np.asarray(b))


def _determinism(env_id: str, env_config: dict, multi_agent: bool) -> str:
    first = _rollout(env_id, env_config, multi_agent, seed=123, steps=10)
    second = _rollout(env_id, env_config, multi_agent, seed=123, steps=10)
    if not all(_same(a, b) for a, b in zip(first, second)):
        raise AssertionError("two resets with seed 123 (and the same actions) gave different observations")
    return "2 x (reset + 10 steps) with seed 123 identical"


def _steps_per_second(env_id: str, env_config: dict, multi_agent: bool, steps: int) -> str:
    start = time.perf_counter()
    _rollout(env_id, env_config, multi_agent, seed=0, steps=steps)
    elapsed = time.perf_counter() - start
    return f"{steps / elapsed:,.0f} env steps/s over {steps} steps"


def _remote(env_id: str, env_config: dict, multi_agent: bool, address: str | None) -> str:
    from rlplatform.adapter.env_runners import sample_in_remote_env_runner
    from rlplatform.config.sizing import Resources
    from rlplatform.infra import local_ray

    data: dict[str, Any] = {"env": env_id, "env_config": env_config, "scale": {"env_runners": 1}}
    if multi_agent:
        data["multi_agent"] = {"policies": ["shared"], "mapping": {"*": "shared"}}
    config = validate(data, source="envs check")
    local_ray.connect(address, Resources(2, 0, [{"CPU": 2, "GPU": 0}]) if address is None else None)
    try:
        result = sample_in_remote_env_runner(config)
    finally:
        local_ray.shutdown()
    return f"{result['env_steps']} env steps in {result['episodes']} episode chunk(s) on node {result['node_id'][:12]}"
