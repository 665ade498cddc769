"""Our envs: `envs list`, `envs check` on each, a short training run of each env's experiment
file with remote env runners, multi-agent metrics per policy, fault injection, and Firehose's
contract (no Ray)."""

import gymnasium as gym
import numpy as np
import pytest
from conftest import ROOT, only_run_dir, read_metrics, run_cli
from gymnasium.utils.env_checker import check_env

import rlplatform_envs  # noqa: F401  (registers the rlplatform/ ids)
from rlplatform_envs.firehose import FirehoseEnv

CHECKS = {
    "rlplatform/CostlySim-v0": "{work_ms: 0.1}",
    "rlplatform/PixelCatch-v0": "{size: 64, frame_stack: 4}",
    "rlplatform/Atari-v0": "{game: ALE/Pong-v5, frame_stack: 4}",
    "rlplatform/Pursuit-v0": "{size: 5}",
    "rlplatform/PettingZooParallel-v0": "{env_module: mpe2.simple_spread_v3, N: 2, max_cycles: 25}",
    "rlplatform/Faulty-v0": "{env: CartPole-v1, crash_probability: 0.0}",
    "rlplatform/Firehose-v0": "{episode_len: 50, obs_size: 8}",
    "rlplatform/MaskedPick-v0": "{n: 6, length: 20}",
}
QUICK = ["--set", "stop.iterations=1", "--set", "stop.return_mean=null", "--set", "checkpoint.every=1"]


def test_envs_list_shows_ours_and_the_suites():
    result = run_cli("envs", "list")
    assert result.returncode == 0, result.stderr
    for env_id in CHECKS:
        assert env_id in result.stdout
    for suite in ("classic control", "box2d", "atari"):
        assert suite in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("env_id", list(CHECKS))
def test_every_env_passes_envs_check(env_id, ray_head):
    result = run_cli("envs", "check", env_id, "--env-config", CHECKS[env_id], "--steps", "500", "--address", ray_head.address)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4/4 checks passed" in result.stdout
    assert "builds in a remote Ray env runner" in result.stdout


def test_envs_check_refuses_an_env_that_cannot_be_built():
    result = run_cli("envs", "check", "rlplatform/CostlySim-v0", "--env-config", "{work_ms: -1}", "--no-ray")
    assert result.returncode == 2 and "cannot be built" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("experiment,extra", [
    ("pixel_catch_ppo.yaml", ["--set", "training.train_batch_size_per_learner=256", "--set", "training.minibatch_size=64"]),
    ("costly_sim_ppo.yaml", ["--set", "training.train_batch_size_per_learner=400"]),
    ("simple_spread_ppo.yaml", ["--set", "training.train_batch_size_per_learner=400"]),
    ("pong_appo.yaml", ["--set", "scale.envs_per_runner=1"]),  # the `bench gpu` preset, here on CPU
])
def test_env_experiment_trains_with_remote_runners(experiment, extra, ray_head, runs):
    result = run_cli("train", ROOT / "experiments" / experiment, "--address", ray_head.address, "--runs-dir", runs,
                     "--set", "scale.env_runners=1", *QUICK, *extra, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = only_run_dir(runs, next(runs.iterdir()).name)
    last = read_metrics(run_dir)[-1]
    assert last["env_steps"] > 0 and last["faults/healthy_env_runners"] >= 1


@pytest.mark.slow
def test_multi_agent_run_reports_per_policy_metrics_and_its_checkpoint_evaluates(ray_head, runs):
    result = run_cli("train", ROOT / "experiments" / "pursuit_ppo.yaml", "--address", ray_head.address, "--runs-dir", runs,
                     *QUICK, "--set", "training.train_batch_size_per_learner=500", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = only_run_dir(runs, "pursuit-ppo")
    last = read_metrics(run_dir)[-1]
    for policy in ("pursuer", "evader"):
        assert f"return/{policy}/mean" in last, sorted(last)
        assert f"learner/{policy}/policy_loss" in last, sorted(last)
    modules = sorted(p.name for p in (run_dir / "checkpoints" / "checkpoint_000001" / "learner_group" / "learner" / "rl_module").iterdir()
                     if p.is_dir())
    assert modules == ["evader", "pursuer"]
    evaluated = run_cli("evaluate", run_dir, "--episodes", "3")
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    assert "policy pursuer: return" in evaluated.stdout and "policy evader: return" in evaluated.stdout


@pytest.mark.slow
def test_fault_injection_run_finishes_despite_crashes(ray_head, runs):
    """Runner processes die (os._exit) mid-sampling; RLlib restarts them and the run still finishes."""
    result = run_cli("train", ROOT / "experiments" / "cartpole_faults_ppo.yaml", "--address", ray_head.address,
                     "--runs-dir", runs, "--set", "env_config.crash_probability=0.002", "--set", "scale.env_runners=2",
                     "--set", "hardware.cpus_per_env_runner=0.5", "--set", "stop.env_steps=4000",
                     "--set", "stop.return_mean=null", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = read_metrics(only_run_dir(runs, "cartpole-faults-ppo"))
    assert rows[-1]["env_steps"] >= 4000
    assert rows[-1]["faults/env_runner_restarts"] > 0
    assert min(r["faults/healthy_env_runners"] for r in rows) < 2  # the drop is on record


# Firehose: the cheapest env, for measuring the pipeline's own cost per env step (`bench ingest`).

def test_firehose_truncates_itself_after_episode_len_steps():
    env = gym.make("rlplatform/Firehose-v0", episode_len=7, obs_size=3)
    assert env.spec is not None and env.spec.max_episode_steps is None  # no TimeLimit: the env truncates itself
    for _ in range(2):  # and again after a reset
        env.reset(seed=1)
        flags = [env.step(0)[2:4] for _ in range(7)]
        assert flags == [(False, False)] * 6 + [(False, True)]


def test_firehose_observations_are_fresh_float32_arrays_in_the_box():
    env = FirehoseEnv(episode_len=200, obs_size=5)
    assert env.observation_space == gym.spaces.Box(-1.0, 1.0, shape=(5,), dtype=np.float32)
    assert env.action_space == gym.spaces.Discrete(2)
    obs, _ = env.reset(seed=3)
    seen = [obs]
    for _ in range(150):  # more than the ring
        seen.append(env.step(1)[0])
    for o in seen:
        assert o.shape == (5,) and o.dtype == np.float32 and env.observation_space.contains(o)
    assert len({o.tobytes() for o in seen}) > 32  # the ring varies
    first = seen[1].copy()
    seen[1][:] = 7.0  # a consumer that writes into an observation cannot change what comes later
    assert not any((o == 7.0).all() for o in seen[2:])
    assert not np.shares_memory(seen[1], seen[1 + 64])
    assert np.array_equal(first, seen[1 + 64])  # the ring repeats


def test_firehose_same_seed_same_observations():
    a, b = FirehoseEnv(), FirehoseEnv()
    obs_a, obs_b = a.reset(seed=11)[0], b.reset(seed=11)[0]
    assert np.array_equal(obs_a, obs_b)
    assert all(np.array_equal(a.step(0)[0], b.step(0)[0]) for _ in range(10))
    assert not np.array_equal(FirehoseEnv().reset(seed=12)[0], obs_a)


def test_firehose_reward_follows_the_target_bit_the_observation_shows():
    env = FirehoseEnv(episode_len=500, obs_size=2)
    for choose, expected in ((lambda bit: bit, 1.0), (lambda bit: 1 - bit, 0.0)):
        obs, _ = env.reset(seed=0)
        targets = set()
        for _ in range(300):
            target = int(obs[0] > 0)
            targets.add(target)
            obs, reward, terminated, _, _ = env.step(np.int64(choose(target)))  # RLlib hands numpy ints
            assert reward == expected and not terminated
        assert targets == {0, 1}


@pytest.mark.parametrize("kwargs,name", [
    ({"episode_len": 0}, "episode_len"), ({"episode_len": -3}, "episode_len"), ({"episode_len": 2.5}, "episode_len"),
    ({"obs_size": 0}, "obs_size"), ({"obs_size": "4"}, "obs_size"), ({"obs_size": True}, "obs_size"),
])
def test_firehose_refuses_bad_arguments_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        FirehoseEnv(**kwargs)


def test_firehose_passes_gymnasiums_env_checker():
    check_env(gym.make("rlplatform/Firehose-v0", episode_len=20, obs_size=6).unwrapped, skip_render_check=True)
    check_env(FirehoseEnv(), skip_render_check=True)
