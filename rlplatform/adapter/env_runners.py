"""Real RLlib env runners outside training: where they run, and building an env inside one."""

from __future__ import annotations

from typing import Any, Optional

from rlplatform.adapter.algorithm_config import build_algorithm_config, env_spaces
from rlplatform.config.schema import ExperimentConfig


def env_runner_node_ids(algo) -> list[str]:
    import ray

    group = algo.env_runner_group
    if group is None or group.num_remote_env_runners() == 0:
        return [ray.get_runtime_context().get_node_id()]
    return group.foreach_env_runner(_node_id, local_env_runner=False)


def _node_id(_runner) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def remote_env_runners(config: ExperimentConfig, count: int, num_cpus: Optional[float] = None,
                       flatten_nested: bool = False) -> list:
    """`count` real remote EnvRunner actors built from the experiment, as training builds them (no learner).
    `flatten_nested`: a Dict or Tuple observation goes through RLlib's FlattenObservations connector, so that
    RLlib's default module (which takes flat observations only) can be built for an env whatever its spaces."""
    import ray
    from ray.rllib.env.multi_agent_env_runner import MultiAgentEnvRunner
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    algo_config = build_algorithm_config(config)
    if flatten_nested and config.multi_agent is None and _nested(env_spaces(config)[0]):
        algo_config.env_runners(env_to_module_connector=_flatten_observations)
    runner_cls = algo_config.env_runner_cls or (MultiAgentEnvRunner if config.multi_agent is not None else SingleAgentEnvRunner)
    actor = ray.remote(num_cpus=config.hardware.cpus_per_env_runner if num_cpus is None else num_cpus)(runner_cls)
    return [actor.remote(config=algo_config, worker_index=i + 1, num_workers=count) for i in range(count)]


def sample_in_remote_env_runner(config: ExperimentConfig, num_timesteps: int = 50) -> dict[str, Any]:
    """Build the env inside a real remote EnvRunner actor (as training does) and sample random actions."""
    import ray

    (runner,) = remote_env_runners(config, 1, num_cpus=0, flatten_nested=True)
    try:
        episodes = ray.get(runner.sample.remote(num_timesteps=num_timesteps, random_actions=True), timeout=120)
        node = ray.get(runner.apply.remote(_node_id), timeout=30)
    finally:
        ray.kill(runner)
    return {"episodes": len(episodes), "env_steps": sum(e.env_steps() for e in episodes), "node_id": node}


def _nested(space: Any) -> bool:
    import gymnasium as gym

    return isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple))


def _flatten_observations(env: Any = None, spaces: Any = None, device: Any = None) -> Any:
    from ray.rllib.connectors.env_to_module import FlattenObservations

    return FlattenObservations()


def check_multi_agent_env(env: Any) -> None:
    """RLlib's own checks of a multi-agent env (spaces, agent ids, step and reset returns); raises on a problem."""
    from ray.rllib.utils.pre_checks.env import check_multiagent_environments

    check_multiagent_environments(env)
