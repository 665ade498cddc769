"""The lean env runner gives what RLlib's SingleAgentEnvRunner gives, and steps aside where it does not apply.

Real env runners built from real experiments, in this process (an EnvRunner needs no Ray to sample).
"""

import numpy as np
import pytest
import torch
from conftest import ROOT

from rlplatform.adapter.algorithm_config import build_algorithm_config
from rlplatform.config.experiment import resolve_experiment


def runner(experiment: str = "cartpole_ppo", *overrides: str, cls=None):

    from rlplatform.internals.lean_env_runner import LeanEnvRunner

    config = resolve_experiment(ROOT / "experiments" / f"{experiment}.yaml", list(overrides), "laptop").config
    return (cls or LeanEnvRunner)(config=build_algorithm_config(config), worker_index=1, num_workers=1)


def test_the_experiments_use_it():
    from rlplatform.internals.lean_env_runner import LeanEnvRunner

    config = resolve_experiment(None).config
    assert issubclass(build_algorithm_config(config).env_runner_cls, LeanEnvRunner)  # SlimEnvRunner where it applies
    rllib = resolve_experiment(None, ["speedups=false"]).config
    assert build_algorithm_config(rllib).env_runner_cls is None


def test_episodes_carry_what_rllib_stores():
    from ray.rllib.core.columns import Columns
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    lean, plain = runner("cartpole_ppo", "scale.envs_per_runner=4"), runner("cartpole_ppo", "scale.envs_per_runner=4", cls=SingleAgentEnvRunner)
    assert lean.lean
    lean_eps, plain_eps = lean.sample(num_timesteps=200), plain.sample(num_timesteps=200)
    assert 200 <= sum(e.env_steps() for e in lean_eps) < 204
    assert set(lean_eps[0].extra_model_outputs) == set(plain_eps[0].extra_model_outputs)
    for episode in lean_eps:
        episode.validate()
        logits = torch.as_tensor(episode.get_extra_model_outputs(Columns.ACTION_DIST_INPUTS))
        actions = torch.as_tensor(episode.get_actions())
        expected = torch.log_softmax(logits, -1).gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
        np.testing.assert_allclose(episode.get_extra_model_outputs(Columns.ACTION_LOGP), expected.numpy(), rtol=1e-5, atol=1e-6)
        assert len(episode.get_observations()) == len(episode) + 1
    done = [e for e in lean_eps if e.is_done]
    assert done and all(e.is_terminated or e.is_truncated for e in done)


def test_an_episode_cut_between_fragments_continues_with_the_same_id():
    lean = runner("cartpole_ppo", "scale.envs_per_runner=2")
    first = lean.sample(num_timesteps=6)  # far shorter than an episode: both come back as chunks
    second = lean.sample(num_timesteps=6)
    assert {e.id_ for e in first} == {e.id_ for e in second}
    by_id = {e.id_: e for e in first}
    for chunk in second:
        assert chunk.t_started == by_id[chunk.id_].t
        np.testing.assert_array_equal(chunk.get_observations(0), by_id[chunk.id_].get_observations(-1))


def test_episode_returns_reach_the_metrics_and_the_callback():
    lean = runner("cartpole_ppo", "scale.envs_per_runner=8")
    episodes = lean.sample(num_timesteps=2000)
    finished = [e for e in episodes if e.is_done]
    metrics = lean.get_metrics()
    assert metrics["num_episodes"].peek() >= len(finished) > 0
    assert len(list(metrics["rlp_episode_returns"].peek())) >= len(finished)


def test_box_actions_are_stored_raw_and_sent_unsquashed():
    lean = runner("pendulum_sac", "scale.envs_per_runner=2")
    assert lean.lean
    episodes = lean.sample(num_timesteps=50)
    raw = np.concatenate([e.get_actions() for e in episodes])
    space = lean.env.single_action_space
    sent = lean._actions_for_env(raw)
    assert np.all(sent >= space.low) and np.all(sent <= space.high)
    np.testing.assert_allclose(sent, np.clip(space.low + (raw + 1.0) * (space.high - space.low) / 2.0, space.low, space.high), rtol=1e-5)


def test_greedy_sampling_is_deterministic_argmax():
    lean = runner("cartpole_ppo", "scale.envs_per_runner=4")
    episodes = lean.sample(num_timesteps=40, explore=False)
    from ray.rllib.core.columns import Columns

    for e in episodes:
        logits = e.get_extra_model_outputs(Columns.ACTION_DIST_INPUTS)
        np.testing.assert_array_equal(e.get_actions(), logits.argmax(-1))


@pytest.mark.parametrize("overrides", [["model.use_lstm=true", "model.max_seq_len=4"]])
def test_stateful_models_take_rllibs_path(overrides):
    lean = runner("cartpole_ppo", "scale.envs_per_runner=2", *overrides)
    assert not lean.lean
    assert sum(e.env_steps() for e in lean.sample(num_timesteps=20)) >= 20


def test_random_actions_and_whole_episodes_take_rllibs_path_and_back():
    lean = runner("cartpole_ppo", "scale.envs_per_runner=2")
    lean.sample(num_timesteps=10)
    assert sum(e.env_steps() for e in lean.sample(num_timesteps=10, random_actions=True)) >= 10
    assert len(lean.sample(num_episodes=2)) >= 2
    assert sum(e.env_steps() for e in lean.sample(num_timesteps=10)) >= 10


def test_episode_callbacks_run_where_someone_listens():
    from collections import Counter

    from ray.rllib.callbacks.callbacks import RLlibCallback

    from rlplatform.internals.lean_env_runner import LeanEnvRunner

    seen = Counter()

    class CountsCreated(RLlibCallback):
        def on_episode_created(self, **_):
            seen["created"] += 1

    config = build_algorithm_config(resolve_experiment(None, ["scale.envs_per_runner=4"]).config)
    config.callbacks(CountsCreated, on_episode_start=lambda **_: seen.update(["start"]))
    lean = LeanEnvRunner(config=config, worker_index=1, num_workers=1)
    assert lean._heard_episode_events == {"on_episode_created", "on_episode_start", "on_episode_end"}
    episodes = lean.sample(num_timesteps=400)
    finished = sum(e.is_done for e in episodes)
    assert finished > 0
    assert seen["created"] >= finished + 4 and seen["start"] >= finished + 4  # the first 4, then one per finished
    assert len(list(lean.get_metrics()["rlp_episode_returns"].peek())) >= finished
