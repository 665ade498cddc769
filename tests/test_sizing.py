"""`--profile auto` sizing and the pre-flight check, on cluster descriptions of several sizes."""

import pytest

from rlplatform.config.experiment import resolve_experiment
from rlplatform.config.sizing import Resources, preflight, size_to_cluster
from rlplatform.errors import UserError


def sized(cpus: float, gpus: float, overrides=()):
    resolved = resolve_experiment(None, list(overrides))
    nodes = [{"CPU": cpus, "GPU": gpus}]
    return size_to_cluster(resolved.config, Resources(cpus, gpus, nodes), resolved.explicit_keys)


def test_laptop_samples_and_learns_in_the_main_process_for_a_synchronous_algorithm():
    config = sized(2, 0)  # one runner would fit: it would only wait while the learner works
    assert (config.scale.env_runners, config.scale.learners, config.hardware.gpus_per_learner) == (0, 0, 0)


def test_laptop_keeps_one_remote_runner_for_an_asynchronous_algorithm():
    config = sized(2, 0, ["algorithm=APPO", "training={}"])
    assert (config.scale.env_runners, config.scale.learners) == (1, 0)


def test_three_cores_get_two_remote_runners():
    assert sized(3, 0).scale.env_runners == 2


def test_one_gpu_gets_a_local_gpu_learner_and_runners_on_every_other_core():
    config = sized(16, 1)
    assert (config.scale.env_runners, config.scale.learners, config.hardware.gpus_per_learner) == (15, 0, 1)


def test_several_gpus_get_one_learner_each():
    config = sized(32, 4)
    assert (config.scale.learners, config.hardware.gpus_per_learner) == (4, 1)
    assert config.scale.env_runners == 32 - 1 - 4  # main process + one CPU per learner


def test_several_cpu_learners_asked_for_are_kept():
    config = sized(8, 0, ["scale.learners=2"])
    assert config.scale.learners == 2
    assert config.scale.env_runners == 8 - 1 - 2


def test_explicit_keys_are_not_resized():
    config = sized(16, 0, ["scale.env_runners=3"])
    assert config.scale.env_runners == 3


def test_preflight_names_the_missing_resource():
    cluster = Resources(2, 0, [{"CPU": 2, "GPU": 0}])
    with pytest.raises(UserError, match="needs 1 GPUs"):
        preflight([{"CPU": 1, "GPU": 1}], cluster)
    with pytest.raises(UserError, match="needs 4 CPUs"):
        preflight([{"CPU": 1}, {"CPU": 1}, {"CPU": 1}, {"CPU": 1}], cluster)
    preflight([{"CPU": 1}, {"CPU": 1}], cluster)


def test_preflight_refuses_a_bundle_no_single_node_holds():
    cluster = Resources(8, 2, [{"CPU": 4, "GPU": 0}, {"CPU": 4, "GPU": 0}, {"CPU": 0, "GPU": 2}])
    with pytest.raises(UserError, match="no node can hold"):
        preflight([{"CPU": 1}, {"CPU": 2, "GPU": 1}], cluster)


def test_fractional_runner_cpus_fit_more_runners():
    config = sized(4, 0, ["hardware.cpus_per_env_runner=0.5"])
    assert config.scale.env_runners == (4 - 1) * 2


def test_runners_that_need_no_cpu_are_left_as_the_experiment_says():
    config = sized(64, 0, ["hardware.cpus_per_env_runner=0", "scale.envs_per_runner=2"])
    assert config.scale.env_runners == resolve_experiment(None).config.scale.env_runners


def test_a_gpu_learner_in_the_main_process_takes_no_cpu_beyond_the_drivers():
    config = sized(4, 1, ["hardware.cpus_per_learner=2"])  # RLlib gives a GPU learner no CPU of its own
    assert (config.scale.learners, config.hardware.gpus_per_learner, config.scale.env_runners) == (0, 1, 3)


def test_a_machine_too_small_for_the_learners_gets_no_runners():
    config = sized(2, 0, ["scale.learners=2"])
    assert config.scale.env_runners == 0  # never negative


def test_preflight_message_breaks_the_request_down():
    cluster = Resources(4, 0, [{"CPU": 4, "GPU": 0}])
    bundles = [{"CPU": 1}] + [{"CPU": 1}] * 6 + [{"CPU": 2}]
    with pytest.raises(UserError) as refused:
        preflight(bundles, cluster)
    message = str(refused.value)
    assert "needs 9 CPUs (1 main process + 6 actors x 1 + 1 actors x 2)" in message
    assert "4 CPUs, 0 GPUs on 1 node(s)" in message and "--profile auto" in message
