"""The lean off-policy path computes what RLlib computes: the flat buffer's n-step targets are RLlib's
buffer's, and the lean DQN and SAC learners' losses, gradients and updates are RLlib's learners'.

Real learners built from the real presets, in this process; episodes from real Pendulum and CartPole
envs through RLlib's own SingleAgentEpisode.
"""

import copy
import re

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import ROOT
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer

from rlplatform.adapter.algorithm_config import build_algorithm_config
from rlplatform.config.experiment import resolve_experiment
from rlplatform.errors import UserError
from rlplatform.internals.flat_replay_buffer import FlatReplayBuffer
from rlplatform.internals.lean_off_policy import _COLUMNS

GAMMA = 0.95


def episode(env_id: str, seed: int, steps: int, *, finish: bool = True) -> SingleAgentEpisode:
    """A real episode of random actions, ended by the env or a time limit at `steps` (or left open)."""
    env = gym.make(env_id)
    env.action_space.seed(seed)
    obs, _ = env.reset(seed=seed)
    ep = SingleAgentEpisode(observations=[obs], observation_space=env.observation_space,
                            action_space=env.action_space)
    for step in range(steps):
        action = env.action_space.sample()
        obs, reward, terminated, truncated, _ = env.step(action)
        truncated = finish and (truncated or step == steps - 1)  # a time limit at `steps`
        ep.add_env_step(obs, action, reward, terminated=terminated, truncated=truncated)
        if terminated or truncated:
            break
    ep.to_numpy()
    return ep


def rllib_rows(ep: SingleAgentEpisode, n_step: int) -> dict[int, dict]:
    """RLlib's EpisodeReplayBuffer's n-step row for every step of `ep` (sampled until each step was drawn)."""
    buffer = EpisodeReplayBuffer(capacity=10_000)
    buffer.add([copy.deepcopy(ep)])
    rows: dict[int, dict] = {}
    while len(rows) < len(ep):
        for one_step in buffer.sample(num_items=64, n_step=n_step, gamma=GAMMA, sample_episodes=True):
            rows[one_step.t_started] = {
                "obs": one_step.get_observations(0), "new_obs": one_step.get_observations(-1),
                "actions": one_step.get_actions(0), "rewards": one_step.get_rewards(0),
                "terminateds": one_step.is_terminated,
                "discount": GAMMA ** one_step.get_extra_model_outputs("n_step", 0) * (not one_step.is_terminated),
            }
    return rows


def flat_rows(buffer: FlatReplayBuffer) -> dict[str, np.ndarray]:
    return {k: v[: buffer.size] for k, v in buffer.columns.items()}


@pytest.mark.parametrize("env_id,n_step", [("CartPole-v1", 1), ("CartPole-v1", 3), ("Pendulum-v1", 3)])
def test_flat_buffer_targets_are_rllibs(env_id, n_step):
    ep = episode(env_id, seed=3, steps=60)
    ours = FlatReplayBuffer(1000, gamma=GAMMA, n_step=n_step)
    ours.add([ep])
    mine = flat_rows(ours)
    assert ours.size == len(ep)
    for t, row in rllib_rows(ep, n_step).items():
        np.testing.assert_allclose(mine["obs"][t], row["obs"], rtol=0, atol=0)
        np.testing.assert_allclose(mine["new_obs"][t], row["new_obs"], rtol=0, atol=0)
        np.testing.assert_allclose(mine["actions"][t], row["actions"], rtol=0, atol=0)
        np.testing.assert_allclose(mine["rewards"][t], row["rewards"], rtol=1e-6)
        ours_discount = GAMMA ** mine["n_step"][t] * (not mine["terminateds"][t])
        if t + n_step <= len(ep):
            assert bool(mine["terminateds"][t]) == row["terminateds"]
            assert ours_discount == pytest.approx(row["discount"])
        else:
            # Fewer than n steps before the episode's end. RLlib's slice past the end reads as not
            # terminated, and the bootstrap is gamma^n: the flat buffer marks these rows terminated
            # after a termination, and discounts by the steps actually summed after a time-limit cut.
            assert bool(mine["terminateds"][t]) == ep.is_terminated
            expected = 0.0 if ep.is_terminated else GAMMA ** (len(ep) - t)
            assert ours_discount == pytest.approx(expected)


def test_fragments_of_one_episode_give_the_rows_of_the_whole_episode():
    whole = episode("CartPole-v1", seed=5, steps=500)
    assert whole.is_terminated and len(whole) > 12
    cut = [whole.slice(slice(a, b)) for a, b in ((0, 4), (4, 5), (5, 11), (11, len(whole)))]
    assert not cut[0].is_done and cut[-1].is_terminated
    at_once, in_parts = FlatReplayBuffer(1000, gamma=GAMMA, n_step=3), FlatReplayBuffer(1000, gamma=GAMMA, n_step=3)
    at_once.add([whole])
    for part in cut:
        in_parts.add([part])
    assert in_parts.size == at_once.size == len(whole) and not in_parts.pending
    for key, column in flat_rows(at_once).items():
        np.testing.assert_array_equal(flat_rows(in_parts)[key], column, err_msg=key)


def test_an_unfinished_fragment_waits_for_the_steps_its_n_step_sums_need():
    ep = episode("Pendulum-v1", seed=1, steps=10, finish=False)
    assert not ep.is_done
    buffer = FlatReplayBuffer(1000, gamma=GAMMA, n_step=3)
    buffer.add([ep])
    assert buffer.size == 8 and set(np.asarray(flat_rows(buffer)["n_step"])) == {3.0}


def test_ring_capacity_keeps_the_newest_transitions():
    buffer = FlatReplayBuffer(50, gamma=GAMMA, n_step=1)
    for seed in range(4):
        buffer.add([episode("Pendulum-v1", seed=seed, steps=30)])
    assert buffer.size == 50 and buffer.added == 120
    last = episode("Pendulum-v1", seed=3, steps=30)
    newest = (buffer.next_index - 1) % 50
    np.testing.assert_array_equal(buffer.columns["new_obs"][newest], last.get_observations(-1))


def test_prioritized_sampling_follows_the_priorities_and_weights_correct_for_them():
    buffer = FlatReplayBuffer(64, gamma=GAMMA, n_step=1, prioritized=True, alpha=1.0, beta=1.0, seed=0)
    buffer.add([episode("Pendulum-v1", seed=0, steps=40)])
    buffer.sample(40)
    priorities = np.linspace(0.1, 4.0, 40)
    buffer.update_priorities(priorities, indices=np.arange(40))
    counts = np.zeros(40)
    for _ in range(200):
        batch = buffer.sample(64)
        np.add.at(counts, buffer.last_indices, 1)
    expected = priorities / priorities.sum()
    np.testing.assert_allclose(counts / counts.sum(), expected, atol=0.01)
    drawn = buffer.last_indices
    np.testing.assert_allclose(batch["weights"], (priorities[drawn] / priorities.min()) ** -1.0, rtol=1e-5)


def test_float64_observations_are_stored_as_float32_as_rllib_hands_them_to_torch():
    ep = episode("HalfCheetah-v5", seed=0, steps=20)
    assert ep.get_observations().dtype == np.float64
    buffer = FlatReplayBuffer(100, gamma=GAMMA, n_step=1)
    buffer.add([ep])
    assert buffer.columns["obs"].dtype == buffer.columns["new_obs"].dtype == np.float32
    np.testing.assert_allclose(buffer.columns["obs"][:20], ep.get_observations()[:20], rtol=1e-6)


def test_buffer_state_round_trips_with_pending_tails_and_priorities():
    buffer = FlatReplayBuffer(100, gamma=GAMMA, n_step=3, prioritized=True, seed=1)
    buffer.add([episode("Pendulum-v1", seed=0, steps=30), episode("Pendulum-v1", seed=1, steps=10, finish=False)])
    buffer.sample(8)
    buffer.update_priorities(np.arange(8.0) + 1)
    restored = FlatReplayBuffer(100, gamma=GAMMA, n_step=3, prioritized=True)
    restored.set_state(copy.deepcopy(buffer.get_state()))
    assert restored.size == buffer.size and list(restored.pending) == list(buffer.pending)
    for key, column in flat_rows(buffer).items():
        np.testing.assert_array_equal(flat_rows(restored)[key], column)
    np.testing.assert_array_equal(restored.sample(16)["obs"], buffer.sample(16)["obs"])


# ---- learners ----------------------------------------------------------------------------------------
def algo_config(experiment: str, *overrides: str):
    config = resolve_experiment(ROOT / "experiments" / f"{experiment}.yaml", list(overrides), "laptop").config
    return build_algorithm_config(config)


def learner_pair(experiment: str, env_id: str, *overrides: str):
    """The lean learner and RLlib's, with the same initial weights (and RLlib's critic loss, which RLlib's has)."""
    learners = []
    loss = ("training.critic_loss=huber",) if experiment.endswith("_sac") else ()
    for switch in ("speedups=true", "speedups=false"):
        torch.manual_seed(0)
        learners.append(algo_config(experiment, switch, *loss, *overrides).build_learner(env=gym.make(env_id)))
    return learners


def train_batch(env_id: str, n_step: int, rows: int, prioritized: bool = False) -> dict[str, torch.Tensor]:
    buffer = FlatReplayBuffer(5000, gamma=0.99, n_step=n_step, prioritized=prioritized, seed=0)
    buffer.add([episode(env_id, seed=s, steps=200) for s in range(6)])
    if prioritized:
        buffer.sample(200)
        buffer.update_priorities(np.random.default_rng(0).random(200) * 3)
    return {_COLUMNS[k]: torch.as_tensor(v) for k, v in buffer.sample(rows).items()}


def named_grads(learner, grads: dict) -> dict[str, torch.Tensor]:
    names = {p: name for name, p in learner.module[DEFAULT_MODULE_ID].named_parameters()}
    for module_id, log_alpha in getattr(learner, "curr_log_alpha", {}).items():
        names[log_alpha] = f"log_alpha/{module_id}"
    return {names[p]: g for p, g in grads.items() if g is not None}


CASES = [("pendulum_sac", "Pendulum-v1", 3, True), ("cartpole_dqn", "CartPole-v1", 1, False),
         ("halfcheetah_sac", "HalfCheetah-v5", 1, False)]  # MuJoCo's observations are float64


def test_the_presets_use_the_lean_path_and_the_switch_turns_it_off():
    from ray.rllib.algorithms.dqn.torch.dqn_torch_learner import DQNTorchLearner
    from ray.rllib.algorithms.sac.torch.sac_torch_learner import SACTorchLearner

    from rlplatform.internals.lean_off_policy import LeanDQN, LeanDQNTorchLearner, LeanSAC, LeanSACTorchLearner

    sac, dqn = algo_config("pendulum_sac"), algo_config("cartpole_dqn")
    assert (sac.algo_class, sac.learner_class, dqn.algo_class, dqn.learner_class) == (
        LeanSAC, LeanSACTorchLearner, LeanDQN, LeanDQNTorchLearner)
    assert sac.store_buffer_in_checkpoints and dqn.store_buffer_in_checkpoints
    plain = algo_config("pendulum_sac", "speedups=false")
    assert plain.learner_class is SACTorchLearner and plain.algo_class.__name__ == "SAC"
    assert algo_config("cartpole_dqn", "speedups=false").learner_class is DQNTorchLearner


@pytest.mark.parametrize("experiment,env_id,n_step,prioritized", CASES)
def test_lean_loss_and_gradients_are_rllibs(experiment, env_id, n_step, prioritized):
    lean, rllib = learner_pair(experiment, env_id)
    batch = train_batch(env_id, n_step, 256, prioritized)
    config = lean.config.get_config_for_module(DEFAULT_MODULE_ID)

    torch.manual_seed(1)
    module = lean.module[DEFAULT_MODULE_ID].unwrapped()
    loss, stats, td_error, grads = lean.lean_loss_and_gradients(DEFAULT_MODULE_ID, module, config, batch)
    torch.manual_seed(1)
    fwd_out = rllib.module[DEFAULT_MODULE_ID].forward_train(batch)
    losses = rllib.compute_losses(fwd_out={DEFAULT_MODULE_ID: fwd_out}, batch={DEFAULT_MODULE_ID: batch})
    rllib_grads = rllib.compute_gradients(losses)

    torch.testing.assert_close(loss, losses[DEFAULT_MODULE_ID], rtol=1e-6, atol=1e-6)
    ours, theirs = named_grads(lean, grads), named_grads(rllib, rllib_grads)
    assert set(ours) == set(theirs) and len(ours) >= 6
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert td_error.shape == (256,) and torch.isfinite(stats["qf_loss"])


@pytest.mark.parametrize("experiment,env_id,n_step,prioritized", CASES)
def test_one_lean_update_of_k_minibatches_is_k_rllib_updates(experiment, env_id, n_step, prioritized):
    lean, rllib = learner_pair(experiment, env_id)
    k, size = 3, 64
    batch = train_batch(env_id, n_step, k * size, prioritized)
    timesteps = {NUM_ENV_STEPS_SAMPLED_LIFETIME: 10_000}

    torch.manual_seed(2)
    ours_results = lean.update(batch=MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(batch)}, k * size),
                               minibatch_size=size, timesteps=timesteps)
    torch.manual_seed(2)
    for i in range(k):
        minibatch = {key: v[i * size:(i + 1) * size] for key, v in batch.items()}
        rllib_results = rllib.update(batch=MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(minibatch)}, size),
                                     timesteps=timesteps)
    # The statistics RLlib logs per minibatch with a window of 1 (losses, Q values, the gradients' global norm):
    # ours, logged once per update, are the last minibatch's.
    theirs_stats, ours_stats = rllib_results[DEFAULT_MODULE_ID], ours_results[DEFAULT_MODULE_ID]
    window_one = [key for key in theirs_stats if key.endswith(("_loss", "_global_norm", "qf_mean", "qf_max", "qf_min"))]
    assert any(key.endswith("_global_norm") for key in window_one) == (experiment == "cartpole_dqn")  # DQN clips
    for key in window_one:
        torch.testing.assert_close(torch.as_tensor(ours_stats[key].peek()).float(),
                                   torch.as_tensor(theirs_stats[key].peek()).float(), rtol=1e-4, atol=1e-5, msg=key)

    ours = lean.module[DEFAULT_MODULE_ID].state_dict()
    for name, value in rllib.module[DEFAULT_MODULE_ID].state_dict().items():  # targets included
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert lean._weights_seq_no == rllib._weights_seq_no == k
    assert lean.last_update_ts_by_mid[DEFAULT_MODULE_ID] == rllib.last_update_ts_by_mid[DEFAULT_MODULE_ID] == 10_000


@pytest.mark.parametrize("clip", [("training.grad_clip=0.05", "training.grad_clip_by=norm"),
                                  ("training.grad_clip=0.05", "training.grad_clip_by=global_norm"),
                                  ("training.grad_clip=0.05", "training.grad_clip_by=value")],
                         ids=["per-tensor", "global", "value"])
def test_clipped_updates_are_rllibs(clip):
    """Clipping hard enough to bite on every minibatch: per tensor and by global norm in foreach kernels, by value
    through RLlib's own function; the same weights after k minibatches."""
    lean, rllib = learner_pair("cartpole_dqn", "CartPole-v1", *clip)
    k, size = 3, 64
    batch = train_batch("CartPole-v1", 1, k * size)
    timesteps = {NUM_ENV_STEPS_SAMPLED_LIFETIME: 10}
    lean.update(batch=MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(batch)}, k * size), minibatch_size=size,
                timesteps=timesteps)
    for i in range(k):
        minibatch = {key: v[i * size:(i + 1) * size] for key, v in batch.items()}
        rllib.update(batch=MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(minibatch)}, size), timesteps=timesteps)
    ours = lean.module[DEFAULT_MODULE_ID].state_dict()
    for name, value in rllib.module[DEFAULT_MODULE_ID].state_dict().items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-6, msg=name)
    unclipped, _ = learner_pair("cartpole_dqn", "CartPole-v1", "training.grad_clip=null")
    unclipped.update(batch=MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(batch)}, k * size), minibatch_size=size,
                     timesteps=timesteps)
    plain = unclipped.module[DEFAULT_MODULE_ID].state_dict()
    assert any(not torch.allclose(ours[name], plain[name], rtol=1e-4, atol=1e-6) for name in plain)  # it clipped


def test_a_non_finite_gradient_is_zeroed_as_rllib_zeroes_it():
    """A NaN reward makes gradients NaN: RLlib's learner zeroes the non-finite entries before Adam's step; ours,
    whose CPU check reads the clipping's norms, too."""
    lean, rllib = learner_pair("cartpole_dqn", "CartPole-v1")
    batch = train_batch("CartPole-v1", 1, 64)
    batch[_COLUMNS["rewards"]][3] = float("nan")
    module, config = lean.module[DEFAULT_MODULE_ID].unwrapped(), lean.config.get_config_for_module(DEFAULT_MODULE_ID)
    _, _, _, grads = lean.lean_loss_and_gradients(DEFAULT_MODULE_ID, module, config, batch)
    assert not all(torch.isfinite(g).all() for g in grads.values())
    timesteps = {NUM_ENV_STEPS_SAMPLED_LIFETIME: 10}  # before the first target update
    lean.update(batch=MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(batch)}, 64), minibatch_size=64, timesteps=timesteps)
    rllib.update(batch=MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(batch)}, 64), timesteps=timesteps)
    ours, theirs = lean.module[DEFAULT_MODULE_ID].state_dict(), rllib.module[DEFAULT_MODULE_ID].state_dict()
    for name, value in theirs.items():
        assert torch.isfinite(ours[name]).all(), name
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_mse_critic_loss_changes_the_critics_gradients_only():
    """`training.critic_loss: mse` (0.5 x squared TD error, SB3's) instead of RLlib's Huber: larger critic losses where
    TD errors exceed 1 (at the start on Pendulum, whose rewards reach -16), the same actor and alpha gradients."""
    results = {}
    for kind in ("huber", "mse"):
        torch.manual_seed(0)
        learner = algo_config("pendulum_sac", f"training.critic_loss={kind}").build_learner(env=gym.make("Pendulum-v1"))
        assert learner.config.learner_config_dict == {"critic_loss": kind}
        module = learner.module[DEFAULT_MODULE_ID].unwrapped()
        torch.manual_seed(1)
        _, stats, _, grads = learner.lean_loss_and_gradients(
            DEFAULT_MODULE_ID, module, learner.config.get_config_for_module(DEFAULT_MODULE_ID), train_batch("Pendulum-v1", 1, 256))
        results[kind] = stats, named_grads(learner, grads)
    (huber_stats, huber_grads), (mse_stats, mse_grads) = results["huber"], results["mse"]
    assert mse_stats["qf_loss"] > huber_stats["qf_loss"] > 0 and mse_stats["qf_twin_loss"] > huber_stats["qf_twin_loss"]
    critics = [name for name in huber_grads if name.startswith("qf")]
    assert critics and all(not torch.allclose(mse_grads[name], huber_grads[name]) for name in critics)
    for name in set(huber_grads) - set(critics):
        torch.testing.assert_close(mse_grads[name], huber_grads[name], msg=name)


@pytest.mark.parametrize("overrides,message", [
    (["training.critic_loss=mse", "speedups=false"], "RLlib's own SAC learner has only huber"),
    (["training.critic_loss=l1"], "training.critic_loss = 'l1': one of huber, mse"),
])
def test_critic_loss_refusals_name_the_key(overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        algo_config("pendulum_sac", *overrides)
    with pytest.raises(UserError, match=re.escape("training.critic_loss: not a DQN hyper-parameter (only SAC)")):
        algo_config("cartpole_dqn", "training.critic_loss=mse")
