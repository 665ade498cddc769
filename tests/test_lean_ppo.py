"""PPO with one request per runner per iteration learns what RLlib's PPO learns, and its runners end in the same state.

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

SMALL = ("scale.env_runners=1", "hardware.cpus_per_env_runner=0.5", "scale.envs_per_runner=2",
         "training.train_batch_size_per_learner=128", "training.minibatch_size=64", "training.num_epochs=2", "seed=3")
RLLIBS_ITERATION = "rllib.env_runners.broadcast_env_runner_states=true"  # any pass-through of the key keeps RLlib's


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
        learned = algo.learner_group.get_state(components="learner/rl_module/default_policy", inference_only=True)
        local = algo.env_runner_group.local_env_runner
        return {"class": type(algo).__name__,
                "steps": [r[NUM_ENV_STEPS_SAMPLED_LIFETIME] for r in results],
                "returns": [r[EPISODE_RETURN_MEAN] for r in results],
                "learned": learned["learner"]["rl_module"]["default_policy"],
                "local": local.get_state(components="rl_module")["rl_module"],
                "local_steps": local.num_env_steps_sampled_lifetime}
    finally:
        algo.stop()


def test_learns_what_rllibs_ppo_learns_from_the_same_samples(local_ray):
    lean, plain = _train((), 3), _train((RLLIBS_ITERATION,), 3)
    assert (lean["class"], plain["class"]) == ("LeanPPO", "PPO")
    assert lean["steps"] == plain["steps"] and lean["steps"][-1] >= 3 * 128
    np.testing.assert_array_equal(lean["returns"], plain["returns"])  # the runner sampled with the same weights
    assert lean["learned"].keys() == plain["learned"].keys()
    for key, value in plain["learned"].items():
        np.testing.assert_array_equal(lean["learned"][key], value, err_msg=key)
    for run in (lean, plain):  # the local runner holds what the learner holds, and the run's step count
        for key, value in run["learned"].items():
            np.testing.assert_array_equal(run["local"][key], value, err_msg=key)
        assert run["local_steps"] == run["steps"][-1]


def test_the_default_ppo_experiment_uses_it_and_a_pass_through_key_turns_it_off():
    config = experiment()
    assert "lean_ppo_sampling" in internals.active(config, local_instance=True)
    assert build_algorithm_config(config).algo_class.__name__ == "LeanPPO"
    plain = experiment(RLLIBS_ITERATION)
    assert "lean_ppo_sampling" not in internals.active(plain, local_instance=True)
    assert build_algorithm_config(plain).algo_class.__name__ == "PPO"
    assert build_algorithm_config(experiment("speedups=false")).algo_class.__name__ == "PPO"
    assert build_algorithm_config(experiment("scale.env_runners=0")).algo_class.__name__ == "PPO"
