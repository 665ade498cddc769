"""Torch-free remote env runners: the numpy policy computes what RLlib's torch module computes.

Real RLlib modules and real remote runners built as training builds them; no mocks.
"""

import json
import sys

import gymnasium as gym
import numpy as np
import pytest
import ray
import torch
from conftest import ROOT

from rlplatform import internals
from rlplatform.adapter.algorithm_config import build_algorithm_config
from rlplatform.adapter.env_runners import remote_env_runners
from rlplatform.config.experiment import resolve_experiment
from rlplatform.config.sizing import Resources
from rlplatform.infra.local_ray import connect as connect_ray
from rlplatform.infra.local_ray import shutdown as shutdown_ray

CARTPOLE = ("cartpole_ppo",)
PENDULUM = ("cartpole_ppo", "env=Pendulum-v1", "model.vf_share_layers=false", "model.head_hidden=[16]", "model.activation=relu")


def experiment(name: str, *overrides: str):
    return resolve_experiment(ROOT / "experiments" / f"{name}.yaml", list(overrides), "laptop").config


def torch_module_and_policy(config):
    from rlplatform.internals.slim_env_runner import numpy_policy_for

    env = gym.make(config.env)
    algo_config = build_algorithm_config(config)
    module = algo_config.get_rl_module_spec(env=env, inference_only=True).build()
    policy = numpy_policy_for(env.observation_space, env.action_space, algo_config.model_config, seed=0)
    policy.set_state(module.get_state())
    return env, module, policy


def env_observations(env: gym.Env, count: int = 1000) -> np.ndarray:
    obs, _ = env.reset(seed=0)
    rows = []
    while len(rows) < count:
        rows.append(obs)
        obs, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            obs, _ = env.reset()
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("overrides", [CARTPOLE, PENDULUM], ids=["cartpole-discrete", "pendulum-box"])
def test_numpy_policy_equals_the_torch_module(overrides):
    from ray.rllib.core.columns import Columns
    from ray.rllib.core.distribution.torch.torch_distribution import TorchCategorical, TorchDiagGaussian

    config = experiment(*overrides)
    assert internals.numpy_policy_applies(config)
    env, module, policy = torch_module_and_policy(config)
    obs = env_observations(env)
    with torch.no_grad():
        expected = module.forward_inference({Columns.OBS: torch.from_numpy(obs)})[Columns.ACTION_DIST_INPUTS]
    got = policy.dist_inputs(obs)
    assert got.dtype == np.float32 and got.shape == tuple(expected.shape)
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-5)

    out = policy.compute_actions(obs, explore=True)
    dist_cls = TorchCategorical if isinstance(env.action_space, gym.spaces.Discrete) else TorchDiagGaussian
    dist = dist_cls.from_logits(expected)
    with torch.no_grad():
        torch_logp = dist.logp(torch.from_numpy(out[Columns.ACTIONS])).numpy()
    np.testing.assert_allclose(out[Columns.ACTION_LOGP], torch_logp, atol=1e-5)
    assert out[Columns.ACTION_LOGP].dtype == np.float32

    greedy = policy.compute_actions(obs, explore=False)
    torch_greedy = dist.to_deterministic().sample().numpy()
    np.testing.assert_allclose(greedy[Columns.ACTIONS], torch_greedy, atol=1e-5)
    assert greedy[Columns.ACTIONS].dtype == torch_greedy.dtype and not greedy[Columns.ACTION_LOGP].any()


def test_sampled_actions_follow_the_distribution():
    from rlplatform.client.numpy_policy import log_softmax, sample_categorical_with_logp

    rng = np.random.default_rng(0)
    logits = np.tile(np.array([[0.0, 1.0, -1.0, 2.0]], np.float32), (200_000, 1))
    logp_all = log_softmax(logits[:1])[0]
    actions, logp = sample_categorical_with_logp(logits, rng)
    counts = np.bincount(actions, minlength=4) / len(logits)
    np.testing.assert_allclose(counts, np.exp(logp_all), atol=0.005)
    np.testing.assert_allclose(logp, logp_all[actions], rtol=1e-5, atol=1e-6)
    assert actions.dtype == np.int64 and logp.dtype == np.float32

    config = experiment(*PENDULUM)
    env, _, policy = torch_module_and_policy(config)
    obs = np.repeat(env_observations(env, 1), 100_000, axis=0)
    mean, log_std = np.split(policy.dist_inputs(obs[:1]), 2, axis=-1)
    actions = policy.compute_actions(obs, explore=True)["actions"]
    np.testing.assert_allclose(actions.mean(0), mean[0], atol=0.02 * np.exp(log_std[0]).max() + 1e-3)
    np.testing.assert_allclose(actions.std(0), np.exp(log_std[0]), rtol=0.02)


def test_what_keeps_torch():
    assert not internals.numpy_policy_applies(experiment("cartpole_ppo", "model.use_lstm=true"))
    assert build_algorithm_config(experiment("cartpole_ppo", "speedups=false")).env_runner_cls is None
    assert not internals.numpy_policy_applies(experiment("pixel_catch_ppo"))  # image observations: a CNN
    assert not internals.numpy_policy_applies(experiment("cartpole_dqn"))
    assert not internals.numpy_policy_applies(experiment("cartpole_ppo", "scale.env_runners=0"))


IN_A_FRESH_PROCESS = """
import json, os, pickle, sys
with open(sys.argv[1], "rb") as f:
    algo_config = pickle.load(f)  # as a remote runner gets it: RLlib and this project load while it unpickles
from ray.rllib.env import single_agent_env_runner
from rlplatform.internals.slim_env_runner import SlimEnvRunner, _cpu_device
runner = SlimEnvRunner(config=algo_config, worker_index=1, num_workers=2)
steps = sum(e.env_steps() for e in runner.sample(num_timesteps=40))
print(json.dumps({"torch": "torch" in sys.modules, "module": type(runner.module).__name__, "steps": steps,
                  "get_device_patched": single_agent_env_runner.get_device is _cpu_device}))
"""


@pytest.mark.slow  # two Python processes that import RLlib (no Ray)
def test_the_torch_free_runner_patches_its_process_only_where_the_hook_is_set(tmp_path):
    """No Ray: a runner process given RLlib's no-torch hook (what `install_in_torch_free_worker` sets in a fresh
    worker creating a SlimEnvRunner) builds the runner with RLlib's `get_device` replaced and without torch;
    a process without the hook builds the same class with torch and RLlib's `get_device` untouched."""
    import os
    import subprocess

    import ray.cloudpickle

    from rlplatform.internals.slim_env_runner import NO_TORCH_FLAG

    config_file = tmp_path / "algo_config.pkl"
    config_file.write_bytes(ray.cloudpickle.dumps(build_algorithm_config(experiment("cartpole_ppo", "scale.env_runners=2"))))
    facts = {}
    for hook in (True, False):
        env = {k: v for k, v in os.environ.items() if k != NO_TORCH_FLAG}
        env.update({NO_TORCH_FLAG: "1"} if hook else {})
        result = subprocess.run([sys.executable, "-c", IN_A_FRESH_PROCESS, str(config_file)], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        facts[hook] = json.loads(result.stdout.strip().splitlines()[-1])
    assert facts[True] == {"torch": False, "module": "NumpyPolicy", "steps": 40, "get_device_patched": True}
    assert facts[False] == {"torch": True, "module": "DefaultPPOTorchRLModule", "steps": 40, "get_device_patched": False}


@pytest.fixture(scope="module")
def local_ray():
    connect_ray(None, Resources(2, 0, [{"CPU": 2, "GPU": 0}]))
    yield
    shutdown_ray()


import ray.cloudpickle as _cloudpickle  # noqa: E402

_cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the functions below run in the runners


def _remote_facts(runner):
    """Torch loaded, the module's class, and the two patches of a torch-free runner's process (the hook, get_device)."""
    import os

    from ray.rllib.env import single_agent_env_runner

    return ("torch" in sys.modules, type(runner.module).__name__, os.environ.get("RLLIB_TEST_NO_TORCH_IMPORT"),
            single_agent_env_runner.get_device.__module__)


def _greedy(runner, obs):
    return runner._compute_actions(obs, False, 0)


@pytest.mark.slow  # a private local Ray instance, two remote runners
def test_remote_runners_sample_without_torch_and_take_synced_weights(local_ray):
    from ray.rllib.core import COMPONENT_RL_MODULE
    from ray.rllib.core.columns import Columns
    from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO

    from rlplatform.internals.lean_env_runner import LeanEnvRunner

    config = experiment("cartpole_ppo", "scale.env_runners=2", "scale.envs_per_runner=2")
    runners = remote_env_runners(config, 2, num_cpus=0)
    try:
        slim = (False, "NumpyPolicy", "1", "rlplatform.internals.slim_env_runner")
        assert ray.get([r.apply.remote(_remote_facts) for r in runners]) == [slim] * 2
        remote_eps = ray.get(runners[0].sample.remote(num_timesteps=100), timeout=120)
        local_eps = LeanEnvRunner(config=build_algorithm_config(config), worker_index=1, num_workers=2).sample(num_timesteps=100)
        for remote_ep, local_ep in zip(remote_eps, local_eps):
            assert set(remote_ep.extra_model_outputs) == set(local_ep.extra_model_outputs)
            for key in local_ep.extra_model_outputs:
                a, b = np.asarray(remote_ep.get_extra_model_outputs(key)), np.asarray(local_ep.get_extra_model_outputs(key))
                assert a.dtype == b.dtype and a.shape[1:] == b.shape[1:], key

        env = gym.make(config.env)
        module = build_algorithm_config(config).get_rl_module_spec(env=env, inference_only=True).build()
        ref = ray.put(module.get_state())
        ray.get([r.set_state.remote({COMPONENT_RL_MODULE: ref, WEIGHTS_SEQ_NO: 1}) for r in runners])
        obs = env_observations(env, 500)
        with torch.no_grad():
            expected = module.forward_inference({Columns.OBS: torch.from_numpy(obs)})[Columns.ACTION_DIST_INPUTS].argmax(-1).numpy()
        for greedy in ray.get([r.apply.remote(_greedy, obs) for r in runners]):
            np.testing.assert_array_equal(greedy[Columns.ACTIONS], expected)
        metrics = ray.get(runners[0].get_metrics.remote())
        assert metrics[internals.WEIGHTS_APPLY_S] >= 0
    finally:
        for r in runners:
            ray.kill(r)


@pytest.mark.slow  # a private local Ray instance
def test_an_ineligible_experiment_samples_remotely_with_torch(local_ray):
    config = experiment("cartpole_ppo", "model.use_lstm=true", "scale.env_runners=1")
    (runner,) = remote_env_runners(config, 1, num_cpus=0)
    try:
        torch_loaded, _, hook, get_device_module = ray.get(runner.apply.remote(_remote_facts))
        assert torch_loaded and hook is None and get_device_module == "ray.rllib.utils.framework"  # nothing patched
        episodes = ray.get(runner.sample.remote(num_timesteps=50), timeout=180)
        assert sum(e.env_steps() for e in episodes) >= 50
    finally:
        ray.kill(runner)
