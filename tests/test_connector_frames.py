"""RLlib's connector pieces record their constructor arguments as before, without inspect.stack()'s source reads."""

import inspect

import gymnasium as gym
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.connectors import connector_v2

from rlplatform.internals import connector_frames


def pipelines():
    env = gym.make("CartPole-v1")
    config = PPOConfig().environment("CartPole-v1")
    return config.build_env_to_module_connector(env=env), config.build_module_to_env_connector(env=env)


def recorded_arguments() -> list[tuple[str, dict]]:
    return [(type(c).__name__, c.get_ctor_args_and_kwargs()) for p in pipelines() for c in p.connectors]


def test_same_frames_as_python_inspect_stack():
    def both():
        return connector_frames._stack_without_source(), inspect.stack()

    ours, python = both()
    assert [f.frame for f in ours] == [f.frame for f in python]
    assert [(f.filename, f.lineno, f.function) for f in ours] == [(f.filename, f.lineno, f.function) for f in python]


def test_connectors_record_the_same_constructor_arguments():
    saved = connector_v2.inspect
    connector_v2.inspect = inspect
    try:
        with_python_inspect = recorded_arguments()
    finally:
        connector_v2.inspect = saved
    connector_frames.install()
    assert connector_v2.inspect.stack is connector_frames._stack_without_source
    assert connector_v2.inspect.getargvalues is inspect.getargvalues
    assert len(with_python_inspect) >= 8
    assert recorded_arguments() == with_python_inspect
    connector_frames.install()  # a second install keeps the first
    assert connector_v2.inspect.stack is connector_frames._stack_without_source
