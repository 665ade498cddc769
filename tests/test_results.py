"""`adapter.results.from_rllib_result`: RLlib's result dict mapped onto our metric names, on real results.

tests/data/rllib_result_{ppo,dqn}.json each hold one real `Algorithm.train()` result of Ray RLlib 2.60.0
(CartPole, one remote env runner; PPO with a short evaluation), saved by tests/data/make_rllib_results.py.
No Ray starts here.
"""

from __future__ import annotations

import copy
import json
import math
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from rlplatform.adapter.results import from_rllib_result

DATA = Path(__file__).resolve().parent / "data"
SKIPPED_PREFIXES = ("num_", "weights_seq_no", "diff_num_grad_updates", "module_train_batch_size")


def saved(name: str) -> dict:
    return json.loads((DATA / f"rllib_result_{name}.json").read_text())


@pytest.fixture(params=["ppo", "dqn"])
def real(request) -> dict:
    return saved(request.param)


def test_the_saved_results_are_real_ones_of_the_pinned_ray():
    for name in ("ppo", "dqn"):
        data = saved(name)
        assert data["ray_version"] == "2.60.0"
        result = data["result"]
        assert {"training_iteration", "time_this_iter_s", "env_runners", "learners", "timers", "fault_tolerance"} <= set(result)
        assert result["env_runners"]["num_episodes"] > 0


def test_counters_episodes_and_timers(real):
    result = real["result"]
    runners, timers = result["env_runners"], result["timers"]
    m = from_rllib_result(copy.deepcopy(result), real["epochs_per_batch"])
    assert m["iteration"] == result["training_iteration"] == 1
    assert m["env_steps"] == int(result["num_env_steps_sampled_lifetime"]) == runners["num_env_steps_sampled"]
    assert m["env_steps_sampled_this_iter"] == runners["num_env_steps_sampled"]
    assert m["episode_returns"] == runners["rlp_episode_returns"] and len(m["episode_returns"]) == runners["num_episodes"]
    assert m["episode_lengths"] == runners["rlp_episode_lengths"]
    assert all(type(r) is float for r in m["episode_returns"]) and all(type(n) is int for n in m["episode_lengths"])
    # CartPole pays 1 per step: each episode's return is its length, and they agree with RLlib's own extremes
    # (its means are smoothed over sampling rounds, not the plain mean of these episodes).
    assert m["episode_returns"] == [float(n) for n in m["episode_lengths"]]
    assert max(m["episode_returns"]) == runners["episode_return_max"] and min(m["episode_returns"]) == runners["episode_return_min"]
    assert max(m["episode_lengths"]) == runners["episode_len_max"] and min(m["episode_lengths"]) == runners["episode_len_min"]
    assert m["time/iteration_s"] == result["time_this_iter_s"]
    assert m["time/sample_s"] == timers["env_runner_sampling_timer"]
    assert m["time/learn_s"] == timers["learner_update_timer"]
    assert m["time/sync_weights_s"] == timers["synch_weights"]
    assert m["faults/healthy_env_runners"] == 1.0 and m["faults/env_runner_restarts"] == 0.0


def test_throughput_is_per_second_of_the_iteration_and_counts_each_sample_once(real):
    result, epochs = real["result"], real["epochs_per_batch"]
    m = from_rllib_result(copy.deepcopy(result), epochs)
    seconds = result["time_this_iter_s"]
    assert m["throughput/env_steps_sampled_per_s"] == pytest.approx(result["env_runners"]["num_env_steps_sampled"] / seconds)
    # RLlib counts a sample once per epoch it is trained in (num_module_steps_trained); we count it once.
    trained = result["learners"]["default_policy"]["num_module_steps_trained"] / epochs
    assert m["throughput/env_steps_trained_per_s"] == pytest.approx(trained / seconds)
    once = from_rllib_result(copy.deepcopy(result))
    assert once["throughput/env_steps_trained_per_s"] == pytest.approx(epochs * m["throughput/env_steps_trained_per_s"])


def test_ppo_learner_stats_are_renamed_and_counters_left_out():
    data = saved("ppo")
    stats = data["result"]["learners"]["default_policy"]
    m = from_rllib_result(copy.deepcopy(data["result"]), data["epochs_per_batch"])
    learner = {k.removeprefix("learner/default_policy/"): v for k, v in m.items() if k.startswith("learner/")}
    assert set(learner) == {"lr", "kl", "curr_entropy_coeff", "entropy", "policy_loss", "total_loss",
                            "vf_explained_var", "vf_loss", "vf_loss_unclipped"}
    assert learner["lr"] == stats["default_optimizer_learning_rate"] == 0.001  # the experiment's training.lr
    assert learner["kl"] == stats["mean_kl_loss"]
    for name in ("policy_loss", "vf_loss", "entropy", "total_loss"):
        assert learner[name] == stats[name]


def test_dqn_learner_stats_keep_their_names_and_there_is_no_kl():
    data = saved("dqn")
    m = from_rllib_result(copy.deepcopy(data["result"]), data["epochs_per_batch"])
    learner = {k.removeprefix("learner/default_policy/"): v for k, v in m.items() if k.startswith("learner/")}
    assert learner["lr"] == 0.0023  # the experiment's training.lr
    assert {"qf_loss", "qf_mean", "td_error_mean", "total_loss"} <= set(learner)
    assert "kl" not in learner and "num_target_updates" not in learner


def test_nothing_left_out_comes_through(real):
    m = from_rllib_result(copy.deepcopy(real["result"]), real["epochs_per_batch"])
    assert all(v is not None for v in m.values()), m
    for key, value in m.items():
        if key.startswith("learner/"):
            module, name = key.split("/")[1:]
            assert module == "default_policy" and not name.startswith(SKIPPED_PREFIXES), key
            assert name not in ("default_optimizer_learning_rate", "mean_kl_loss"), key  # renamed
            assert type(value) is float and math.isfinite(value), key
    assert not any("__all_modules__" in key for key in m)
    assert not any(key.startswith("return/") for key in m)  # single-agent: the driver's window gives return/mean
    json.dumps(m)  # it goes to metrics.jsonl as it is


def test_evaluation_numbers_when_the_run_evaluates():
    ppo, dqn = saved("ppo"), saved("dqn")
    evaluated = ppo["result"]["evaluation"]["env_runners"]
    m = from_rllib_result(copy.deepcopy(ppo["result"]), ppo["epochs_per_batch"])
    assert m["eval/return_mean"] == evaluated["episode_return_mean"]
    assert m["eval/episode_length_mean"] == evaluated["episode_len_mean"]
    without = from_rllib_result(copy.deepcopy(dqn["result"]), dqn["epochs_per_batch"])
    assert "eval/return_mean" not in without and "eval/episode_length_mean" not in without


def test_a_single_episode_arrives_as_a_bare_item_and_still_makes_a_list():
    result = saved("ppo")["result"]
    result["env_runners"]["rlp_episode_returns"], result["env_runners"]["rlp_episode_lengths"] = 12.0, 12
    m = from_rllib_result(result, 3)
    assert m["episode_returns"] == [12.0] and m["episode_lengths"] == [12]
    result["env_runners"]["rlp_episode_returns"] = deque([3.0, 4.0])
    result["env_runners"]["rlp_episode_lengths"] = (3, 4)
    m = from_rllib_result(result, 3)
    assert m["episode_returns"] == [3.0, 4.0] and m["episode_lengths"] == [3, 4]
    del result["env_runners"]["rlp_episode_returns"], result["env_runners"]["rlp_episode_lengths"]
    m = from_rllib_result(result, 3)
    assert m["episode_returns"] == [] and m["episode_lengths"] == []


def test_an_iteration_without_time_gives_no_throughput():
    result = saved("ppo")["result"]
    result["time_this_iter_s"] = 0.0
    m = from_rllib_result(result, 3)
    assert "throughput/env_steps_sampled_per_s" not in m and "throughput/env_steps_trained_per_s" not in m
    assert m["time/iteration_s"] == 0.0


def test_numpy_scalars_count_and_non_finite_numbers_and_flags_are_dropped():
    result = saved("ppo")["result"]
    stats = result["learners"]["default_policy"]
    stats["policy_loss"] = np.float32(0.25)
    stats["vf_loss"] = float("nan")
    stats["entropy"] = np.float64("inf")
    stats["a_flag"] = True
    stats["a_note"] = "text"
    result["timers"]["synch_weights"] = np.array(0.5)  # 0-d array, as a torch or numpy reduce gives
    m = from_rllib_result(result, 3)
    assert m["learner/default_policy/policy_loss"] == 0.25 and type(m["learner/default_policy/policy_loss"]) is float
    for name in ("vf_loss", "entropy", "a_flag", "a_note"):
        assert f"learner/default_policy/{name}" not in m
    assert m["time/sync_weights_s"] == 0.5


def test_multi_agent_returns_per_policy():
    result = saved("ppo")["result"]
    result["env_runners"]["module_episode_returns_mean"] = {"pursuer": 3.5, "evader": -1.0}
    result["learners"]["pursuer"] = {"policy_loss": 0.5, "num_module_steps_trained": 100}
    m = from_rllib_result(result, 3)
    assert m["return/pursuer/mean"] == 3.5 and m["return/evader/mean"] == -1.0
    assert m["learner/pursuer/policy_loss"] == 0.5 and "learner/pursuer/num_module_steps_trained" not in m
    # A single-agent runner's per-module mean names only default_policy: no per-policy curve.
    result["env_runners"]["module_episode_returns_mean"] = {"default_policy": 20.0}
    assert not any(k.startswith("return/") for k in from_rllib_result(result, 3))


def test_an_empty_result_maps_to_zeros_and_no_none():
    assert from_rllib_result({}) == {"iteration": 0, "env_steps": 0, "episode_returns": [], "episode_lengths": [],
                                     "env_steps_sampled_this_iter": 0.0, "time/iteration_s": 0.0}


def test_weights_apply_time_maps_to_our_name():
    from rlplatform.internals import WEIGHTS_APPLY_S

    m = from_rllib_result({"env_runners": {WEIGHTS_APPLY_S: 0.125}, "training_iteration": 1})
    assert m["time/weights_apply_s"] == 0.125
    assert "time/weights_apply_s" not in from_rllib_result({"env_runners": {}, "training_iteration": 1})
