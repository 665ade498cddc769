"""PPO with one request per runner per iteration learns what RLlib's PPO learns, and its runners end in the same state;
so does it when relay actors make the requests (and the learner fetches the episodes), and a runner lost under them
is replaced.

Real algorithms built as `train` builds them, with a real remote runner on a private local Ray instance.
"""

import numpy as np
import pytest
from conftest import ROOT

from rlplatform import internals
from rlplatform.adapter.algorithm_config import build_algorithm_config
from rlplatform.config.experiment import resolve_experiment
from rlplatform.config.sizing import Resources
from rlplatform.infra.local_ray import connect as connect_ray
from rlplatform.infra.local_ray import shutdown as shutdown_ray

pytestmark = pytest.mark.slow

SMALL = ("scale.env_runners=3", "scale.runners_per_relay=0", "hardware.cpus_per_env_runner=0.3", "scale.envs_per_runner=2",
         "training.train_batch_size_per_learner=128", "training.minibatch_size=64", "training.num_epochs=2", "seed=3")
RLLIBS_ITERATION = "rllib.env_runners.broadcast_env_runner_states=true"  # any pass-through of the key keeps RLlib's
RELAYS = "scale.runners_per_relay=2"  # 3 runners: one relay for runner 1, one for runners 2 and 3


def experiment(*overrides: str):
    return resolve_experiment(ROOT / "experiments" / "cartpole_ppo.yaml", [*SMALL, *overrides], "laptop").config


@pytest.fixture(scope="module")
def local_ray():
    connect_ray(None, Resources(2, 0, [{"CPU": 2, "GPU": 0}]))
    yield
    shutdown_ray()


def _train(overrides: tuple[str, ...], iterations: int) -> dict:
    from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS, EPISODE_RETURN_MEAN, NUM_ENV_STEPS_SAMPLED_LIFETIME

    algo = build_algorithm_config(experiment(*overrides)).build_algo()
    try:
        results = [algo.train()[ENV_RUNNER_RESULTS] for _ in range(iterations)]
        relays = list(getattr(algo, "_relays", []))
        learned = algo.learner_group.get_state(components="learner/rl_module/default_policy", inference_only=True)
        local = algo.env_runner_group.local_env_runner
        return {"class": type(algo).__name__,
                "steps": [r[NUM_ENV_STEPS_SAMPLED_LIFETIME] for r in results],
                "returns": [r[EPISODE_RETURN_MEAN] for r in results],
                "learned": learned["learner"]["rl_module"]["default_policy"],
                "local": local.get_state(components="rl_module")["rl_module"],
                "local_steps": local.num_env_steps_sampled_lifetime,
                "relays": relays}
    finally:
        algo.stop()


def test_learns_what_rllibs_ppo_learns_from_the_same_samples_with_and_without_relays(local_ray):
    import ray

    lean, relayed, plain = _train((), 3), _train((RELAYS,), 3), _train((RLLIBS_ITERATION,), 3)
    assert (lean["class"], relayed["class"], plain["class"]) == ("LeanPPO", "LeanPPO", "PPO")
    assert (len(lean["relays"]), [ids for _, ids in relayed["relays"]]) == (0, [[1], [2, 3]])
    for run in (lean, relayed):
        assert run["steps"] == plain["steps"] and run["steps"][-1] >= 3 * 128
        np.testing.assert_array_equal(run["returns"], plain["returns"])  # the runners sampled with the same weights
        assert run["learned"].keys() == plain["learned"].keys()
        for key, value in plain["learned"].items():
            np.testing.assert_array_equal(run["learned"][key], value, err_msg=key)
    for relay, _ in relayed["relays"]:  # stopped with the algorithm
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(relay.sample.remote([None], [], 1.0), timeout=30)
    for run in (lean, relayed, plain):  # the local runner holds what the learner holds, and the run's step count
        for key, value in run["learned"].items():
            np.testing.assert_array_equal(run["local"][key], value, err_msg=key)
        assert run["local_steps"] == run["steps"][-1]


def test_a_runner_killed_under_a_relay_is_taken_out_of_service_and_comes_back(local_ray):
    import ray
    from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME

    algo = build_algorithm_config(experiment(RELAYS)).build_algo()
    try:
        algo.train()
        runner = algo.env_runner_group._worker_manager._actors[2]  # with runner 3 under the second relay
        ray.kill(runner, no_restart=False)  # Ray restarts it (RLlib's max_restarts); its next reply is an error
        steps = [algo.train()[ENV_RUNNER_RESULTS][NUM_ENV_STEPS_SAMPLED_LIFETIME] for _ in range(4)]
        assert steps == sorted(steps) and steps[-1] - steps[0] >= 3 * 128
        assert algo.env_runner_group.healthy_env_runner_ids() == [1, 2, 3]
        assert algo.env_runner_group.num_remote_worker_restarts() == 1  # taken out of service, restored by RLlib's probe
        assert [ids for _, ids in algo._relays] == [[1], [2, 3]]
    finally:
        algo.stop()


def test_a_killed_relay_is_replaced_and_its_runners_come_back(local_ray):
    import ray
    from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME

    algo = build_algorithm_config(experiment(RELAYS)).build_algo()
    try:
        algo.train()
        (first, _), (second, _) = algo._relays
        ray.kill(second)  # runners 2 and 3 are alive but unreachable through it
        steps = [algo.train()[ENV_RUNNER_RESULTS][NUM_ENV_STEPS_SAMPLED_LIFETIME] for _ in range(4)]
        assert steps == sorted(steps) and steps[-1] - steps[0] >= 3 * 128
        assert [ids for _, ids in algo._relays] == [[1], [2, 3]]
        assert algo._relays[1][0] != second and algo._relays[0][0] != first  # all replaced, the old ones stopped
        assert algo.env_runner_group.healthy_env_runner_ids() == [1, 2, 3]
        assert algo.env_runner_group.num_remote_worker_restarts() == 2  # out of service, back after RLlib's probe
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(first.sample.remote([None], [], 1.0), timeout=30)
        for runner_id in (1, 2, 3):  # none healthy: a round brings nothing, as RLlib's foreach_env_runner
            algo.env_runner_group._worker_manager.set_actor_state(runner_id, healthy=False)
        assert algo._sample_through_relays(None, 2) == ([], [])
        before = steps[-1]
        assert algo.train()[ENV_RUNNER_RESULTS][NUM_ENV_STEPS_SAMPLED_LIFETIME] >= before  # restored by RLlib's probe
        assert algo.train()[ENV_RUNNER_RESULTS][NUM_ENV_STEPS_SAMPLED_LIFETIME] > before
    finally:
        algo.stop()


def test_the_default_ppo_experiment_uses_it_and_a_pass_through_key_turns_it_off():
    config = experiment()
    assert "lean_ppo_sampling" in internals.active(config, local_instance=True)
    assert "sample_relays" not in internals.active(config, local_instance=True)
    assert "sample_relays" in internals.active(experiment(RELAYS), local_instance=True)
    assert build_algorithm_config(config).algo_class.__name__ == "LeanPPO"
    plain = experiment(RLLIBS_ITERATION)
    assert "lean_ppo_sampling" not in internals.active(plain, local_instance=True)
    assert build_algorithm_config(plain).algo_class.__name__ == "PPO"
    assert build_algorithm_config(experiment("speedups=false")).algo_class.__name__ == "PPO"
    assert build_algorithm_config(experiment("scale.env_runners=0")).algo_class.__name__ == "PPO"
