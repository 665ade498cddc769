"""Action masking (`model.action_mask`): illegal actions are never taken, and `actions/illegal` counts them.

The quick tests build the masked module from the experiment and drive it and a real env runner in this process:
every sampled and greedy action is legal, the loss's logits are masked, a checkpoint of the module loads back,
and the counter counts an illegal action when one is taken. The slow ones train `experiments/masked_pick_ppo.yaml`
to its target through `train` (PPO; APPO and IMPALA on remote runners) with the counter at 0 in every
iteration, then `evaluate` it greedily.
"""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import ROOT, assert_user_error, only_run_dir, read_metrics, run_cli
from test_offline_train import cli_error

import rlplatform_envs  # noqa: F401  (registers the rlplatform/ ids)
from rlplatform.adapter.action_mask import count_illegal, illegal_in
from rlplatform.adapter.algorithm_config import ILLEGAL_ACTIONS, build_algorithm_config
from rlplatform.config.experiment import resolve_experiment

MASKED = str(ROOT / "experiments" / "masked_pick_ppo.yaml")


def _algo_config(*overrides: str):
    config = resolve_experiment(Path(MASKED), ["scale.env_runners=0", "scale.envs_per_runner=2", *overrides]).config
    return build_algorithm_config(config)


def _module(algo_config):
    env = gym.make("rlplatform/MaskedPick-v0")
    return algo_config.get_rl_module_spec(env=env).build(), env


def _batch(observations: list[dict]) -> dict:
    from ray.rllib.core.columns import Columns

    return {Columns.OBS: {
        "observation": torch.as_tensor(np.stack([o["observation"] for o in observations])),
        "action_mask": torch.as_tensor(np.stack([o["action_mask"] for o in observations])),
    }}


def _observations(env, n: int) -> list[dict]:
    obs, _ = env.reset(seed=0)
    out = []
    for _ in range(n):
        out.append(obs)
        obs, _, terminated, truncated, _ = env.step(int(np.flatnonzero(obs["action_mask"])[0]))
        if terminated or truncated:
            obs, _ = env.reset()
    return out


@pytest.mark.parametrize("algorithm", ["PPO", "APPO", "IMPALA"])
def test_sampled_and_greedy_actions_are_legal_and_the_loss_sees_masked_logits(algorithm):
    from ray.rllib.core.columns import Columns

    module, env = _module(_algo_config(f"algorithm={algorithm}", "training={}"))
    observations = _observations(env, 256)
    masks = np.stack([o["action_mask"] for o in observations])
    with torch.no_grad():
        explore = module.forward_exploration(_batch(observations))[Columns.ACTION_DIST_INPUTS]
        greedy = module.forward_inference(_batch(observations))[Columns.ACTION_DIST_INPUTS]
        train = module.forward_train(_batch(observations))
        values = module.compute_values(_batch(observations))
    dist = module.get_exploration_action_dist_cls().from_logits(explore)
    for _ in range(20):
        sampled = dist.sample().numpy()
        assert masks[np.arange(len(sampled)), sampled].all()
    assert masks[np.arange(len(masks)), greedy.argmax(-1).numpy()].all()
    np.testing.assert_array_equal(train[Columns.ACTION_DIST_INPUTS].numpy() == torch.finfo(torch.float32).min, masks == 0)
    assert values.shape == (256,) and torch.isfinite(values).all()
    if algorithm == "APPO":  # the loss's old policy (APPO's target network) is masked too
        from ray.rllib.core.rl_module.apis.target_network_api import TARGET_NETWORK_ACTION_DIST_INPUTS

        module.make_target_networks()  # as APPO's learner does when it builds
        with torch.no_grad():
            target = module.forward_target(_batch(observations))[TARGET_NETWORK_ACTION_DIST_INPUTS]
        np.testing.assert_array_equal(target.numpy() == torch.finfo(torch.float32).min, masks == 0)
    assert module.observation_space == env.observation_space  # what the runners' connectors see


def test_a_masked_module_saved_and_loaded_acts_the_same(tmp_path):
    from ray.rllib.core.columns import Columns
    from ray.rllib.core.rl_module.rl_module import RLModule

    module, env = _module(_algo_config())
    module.save_to_path(tmp_path / "module")
    loaded = RLModule.from_checkpoint(tmp_path / "module")
    batch = _batch(_observations(env, 32))
    with torch.no_grad():
        expected = module.forward_inference(batch)[Columns.ACTION_DIST_INPUTS]
        got = loaded.forward_inference(batch)[Columns.ACTION_DIST_INPUTS]
    torch.testing.assert_close(got, expected)


def test_an_env_runner_counts_no_illegal_action_and_the_counter_counts_one():
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode
    from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

    algo_config = _algo_config()
    runner = algo_config.env_runner_cls(config=algo_config, worker_index=0)
    try:
        chunks = [c for _ in range(5) for c in runner.sample(num_timesteps=100, explore=True)]
        assert sum(len(c) for c in chunks) >= 500
        assert runner.get_metrics()[ILLEGAL_ACTIONS] == 0
    finally:
        runner.stop()

    env = gym.make("rlplatform/MaskedPick-v0")
    obs, _ = env.reset(seed=1)
    episode = SingleAgentEpisode(observations=[obs], observation_space=env.observation_space,
                                 action_space=env.action_space)
    legal = int(np.flatnonzero(obs["action_mask"])[0])
    obs, reward, *_ = env.step(legal)
    episode.add_env_step(observation=obs, action=legal, reward=reward)
    illegal = int(np.flatnonzero(obs["action_mask"] == 0)[0])
    mask_before = obs["action_mask"].copy()
    obs, reward, terminated, _, _ = env.step(illegal)
    assert terminated and reward == -1.0
    episode.add_env_step(observation=obs, action=illegal, reward=reward, terminated=True)
    assert illegal_in({"action_mask": np.stack([o["action_mask"] for o in episode.get_observations()])},
                      episode.get_actions(), "action_mask") == 1
    assert not mask_before[illegal]
    logger = MetricsLogger()
    count_illegal("action_mask")(samples=[episode], metrics_logger=logger)
    assert logger.peek(ILLEGAL_ACTIONS) == 1


def test_masking_that_cannot_apply_is_refused_before_ray_starts(capsys):
    assert "model.action_mask does not go with DQN" in cli_error(
        capsys, MASKED, "--set", "algorithm=DQN", "--set", "training={}")
    assert "model.action_mask does not go with model.use_lstm" in cli_error(capsys, MASKED, "--set", "model.use_lstm=true")
    assert "a Dict with that key" in cli_error(capsys, MASKED, "--set", "env=CartPole-v1", "--set", "env_config={}")
    line = cli_error(capsys, MASKED, "--set", "model.action_mask=legal")
    assert "its keys: action_mask, observation" in line


@pytest.mark.slow
@pytest.mark.learning
def test_ppo_with_a_mask_learns_masked_pick_without_an_illegal_action_and_evaluates_greedily(runs, tmp_path):
    result = run_cli("train", MASKED, "--runs-dir", runs, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stopped: return/mean" in result.stdout, result.stdout[-2000:]
    run_dir = only_run_dir(runs, "masked-pick-ppo")
    rows = read_metrics(run_dir)
    assert [r["actions/illegal"] for r in rows] == [0] * len(rows)
    assert rows[0]["return/mean"] < 12 <= 19.5 <= rows[-1]["return/mean"]  # random masked play earns about 7

    report = tmp_path / "eval.json"
    result = run_cli("evaluate", run_dir, "--episodes", "10", "--json", report)
    assert result.returncode == 0, result.stderr
    evaluated = json.loads(report.read_text())
    assert evaluated["illegal_actions"] == 0 and min(evaluated["returns"]) >= 18

    line = assert_user_error(run_cli("export", run_dir, "-o", tmp_path / "export"), "does not export yet")
    assert "model.action_mask" in line and not (tmp_path / "export").exists()


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["APPO", "IMPALA"])
def test_appo_and_impala_mask_on_remote_runners(algorithm, ray_head, runs):
    result = run_cli("train", MASKED, "--address", ray_head.address, "--runs-dir", runs,
                     "--set", f"algorithm={algorithm}", "--set", "training={lr: 0.0005}", "--set", "scale.env_runners=1",
                     "--set", "scale.envs_per_runner=2", "--set", "stop.env_steps=4000", "--set", "stop.return_mean=null",
                     "--set", "rllib.reporting.min_time_s_per_iteration=1",
                     timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = read_metrics(only_run_dir(runs, "masked-pick-ppo"))
    counted = [r["actions/illegal"] for r in rows if "actions/illegal" in r]  # an iteration may get no samples
    assert len(counted) >= 2 and counted == [0] * len(counted), counted
    assert rows[-1]["env_steps"] >= 4000
