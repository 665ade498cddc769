"""`scale.aggregators_per_learner`: APPO/IMPALA's aggregator actors (RLlib's num_aggregator_actors_per_learner).

The quick tests build real plans (schema, RLlib's config and bundles, pre-flight, `--profile auto`) without starting
Ray; the slow one trains APPO through the CLI and sees an aggregator actor's process under the run."""

import subprocess
import sys
import time

import pytest
from conftest import ROOT, only_run_dir, read_metrics

from rlplatform.config import layouts
from rlplatform.config.experiment import resolve_experiment
from rlplatform.config.schema import validate
from rlplatform.config.sizing import Resources
from rlplatform.errors import UserError
from rlplatform.run.plan import make_plan, runs_algorithm_in_driver

TWO_CORES = Resources(2, 0, [{"CPU": 2, "GPU": 0}])
EIGHT_CORES = Resources(8, 0, [{"CPU": 8, "GPU": 0}])
SIXTEEN_CORES = Resources(16, 0, [{"CPU": 16, "GPU": 0}])
APPO = ["algorithm=APPO", "training={}"]  # the default experiment's PPO minibatch settings do not apply to APPO


@pytest.fixture(autouse=True)
def empty_layout_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(layouts.CACHE_ENV, str(tmp_path / "cache"))


def plan_for(overrides, resources=EIGHT_CORES, profile="laptop"):
    return make_plan(resolve_experiment(None, list(overrides), profile), resources, joined_cluster=False, resize=True)


def cpus(bundles):
    return sum(b.get("CPU", 0.0) for b in bundles)


def test_the_key_defaults_to_zero_and_validates():
    assert validate({}).scale.aggregators_per_learner == 0
    for algorithm in ("APPO", "IMPALA", "appo"):
        assert validate({"algorithm": algorithm, "scale": {"aggregators_per_learner": 2}}).scale.aggregators_per_learner == 2
    with pytest.raises(UserError, match=r"scale\.aggregators_per_learner = -1: .*greater than or equal to 0"):
        validate({"algorithm": "APPO", "scale": {"aggregators_per_learner": -1}})
    with pytest.raises(UserError, match=r"scale\.aggregators_per_learner = 'two'"):
        validate({"algorithm": "APPO", "scale": {"aggregators_per_learner": "two"}})


@pytest.mark.parametrize("algorithm", ["PPO", "DQN", "SAC"])
def test_the_key_is_refused_for_algorithms_without_aggregators(algorithm):
    with pytest.raises(UserError) as info:
        validate({"algorithm": algorithm, "scale": {"aggregators_per_learner": 1}}, source="exp.yaml")
    assert str(info.value) == (f"exp.yaml: scale.aggregators_per_learner = 1: only APPO and IMPALA use aggregator actors, "
                               f"not {algorithm} (set it to 0)")
    assert validate({"algorithm": algorithm, "scale": {"aggregators_per_learner": 0}}).scale.aggregators_per_learner == 0


def test_set_on_the_command_line_is_refused_for_ppo():
    with pytest.raises(UserError, match=r"scale\.aggregators_per_learner = 1: only APPO and IMPALA"):
        resolve_experiment(None, ["scale.aggregators_per_learner=1"])


def test_it_maps_onto_rllibs_config_only_when_given():
    from rlplatform.adapter.algorithm_config import build_algorithm_config

    config = resolve_experiment(None, [*APPO, "scale.aggregators_per_learner=2", "scale.learners=1"], "laptop").config
    algo_config = build_algorithm_config(config)
    assert algo_config.num_aggregator_actors_per_learner == 2
    assert algo_config.num_learners == 1
    plain = build_algorithm_config(resolve_experiment(None, APPO, "laptop").config)
    assert plain.num_aggregator_actors_per_learner == 0  # RLlib's default, left alone


@pytest.mark.parametrize("learners,aggregators", [(0, 1), (0, 3), (1, 1), (2, 2)])
def test_bundles_hold_one_cpu_per_aggregator_actor(learners, aggregators):
    """RLlib starts max(learners, 1) x N aggregators (1 CPU each) inside the group; its bundles hold them already
    (one bundle each with the learner in the main process, else +N CPUs per learner bundle): counted once."""
    common = [*APPO, "scale.env_runners=2", f"scale.learners={learners}"]
    without = plan_for(common, SIXTEEN_CORES).bundles
    with_them = plan_for([*common, f"scale.aggregators_per_learner={aggregators}"], SIXTEEN_CORES).bundles
    assert cpus(with_them) == cpus(without) + max(learners, 1) * aggregators
    if learners == 0:
        assert with_them == without + [{"CPU": 1.0}] * aggregators
    else:
        assert len(with_them) == len(without)
        assert [b["CPU"] for b in with_them[-learners:]] == [b["CPU"] + aggregators for b in without[-learners:]]


def test_a_run_with_aggregators_never_keeps_the_algorithm_in_the_driver():
    alone = plan_for([*APPO, "scale.env_runners=0"], TWO_CORES)
    assert alone.bundles == [{"CPU": 1.0}] and alone.algorithm_in_driver  # one CPU process: the driver holds it
    with_one = plan_for([*APPO, "scale.env_runners=0", "scale.aggregators_per_learner=1"], TWO_CORES)
    assert with_one.bundles == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert not with_one.algorithm_in_driver  # an actor in the placement group, which holds the aggregator's bundle


def test_where_the_algorithm_runs_follows_scale_algorithm_in():
    runners = [*APPO, "scale.env_runners=1"]
    assert plan_for(runners, TWO_CORES).algorithm_in_driver  # auto, a private local instance: no actor to start
    assert not plan_for([*runners, "scale.algorithm_in=actor"], TWO_CORES).algorithm_in_driver
    assert plan_for([*runners, "scale.aggregators_per_learner=1", "scale.algorithm_in=driver"], SIXTEEN_CORES).algorithm_in_driver
    bundles = [{"CPU": 1.0}, {"CPU": 1.0}]
    on_a_cluster = resolve_experiment(None, runners, "laptop").config
    assert not runs_algorithm_in_driver(on_a_cluster, bundles, joined_cluster=True)  # the actor places the run's actors
    with pytest.raises(UserError, match="scale.algorithm_in: driver needs a private local instance"):
        runs_algorithm_in_driver(resolve_experiment(None, [*runners, "scale.algorithm_in=driver"], "laptop").config,
                                 bundles, joined_cluster=True)
    assert not runs_algorithm_in_driver(on_a_cluster, [{"CPU": 1.0, "GPU": 1.0}], joined_cluster=False)  # a GPU learner


def test_several_learners_without_aggregators_need_a_whole_sample_each():
    two = [*APPO, "scale.learners=2", "scale.envs_per_runner=32", "scale.rollout_fragment_length=50"]
    with pytest.raises(UserError, match=r"2 learners and no aggregators .* samples of 1,600 env steps .* a train batch "
                                        r"of 1,000 takes 1 sample\(s\)"):
        plan_for([*two, "training.train_batch_size_per_learner=500"], SIXTEEN_CORES)
    assert plan_for([*two, "training.train_batch_size_per_learner=1600"], SIXTEEN_CORES)  # one sample per learner
    assert plan_for([*two, "training.train_batch_size_per_learner=500", "scale.aggregators_per_learner=1"], SIXTEEN_CORES)


def test_fractional_cpu_learners_that_fit_two_to_a_bundle_are_refused_with_aggregators():
    two = [*APPO, "scale.learners=2", "scale.aggregators_per_learner=1"]
    with pytest.raises(UserError, match=r"hardware.cpus_per_learner = 0.5 with 2 CPU learners .* whole number of CPUs"):
        plan_for([*two, "hardware.cpus_per_learner=0.5"], SIXTEEN_CORES)
    for fits in ("1", "1.5", "2"):  # whole CPUs leave whole CPUs for the aggregators; 1.5: two learners exceed a bundle
        assert plan_for([*two, f"hardware.cpus_per_learner={fits}"], SIXTEEN_CORES)
    assert plan_for([*APPO, "scale.learners=1", "scale.aggregators_per_learner=2", "hardware.cpus_per_learner=0.5"], SIXTEEN_CORES)


def test_preflight_refuses_a_cluster_too_small_for_the_aggregators():
    fits = plan_for([*APPO, "scale.env_runners=1"], TWO_CORES)
    assert cpus(fits.bundles) == 2
    with pytest.raises(UserError, match=r"the run needs 3 CPUs \(1 main process \+ 2 actors x 1\) but the cluster has 2"):
        plan_for([*APPO, "scale.env_runners=1", "scale.aggregators_per_learner=1"], TWO_CORES)
    one_node_of_two = Resources(4, 0, [{"CPU": 2, "GPU": 0}, {"CPU": 2, "GPU": 0}])
    with pytest.raises(UserError, match="no node can hold a bundle of 3 CPU"):  # a learner bundle with its 2 aggregators
        plan_for([*APPO, "scale.env_runners=0", "scale.learners=1", "scale.aggregators_per_learner=2",
                  "hardware.driver_cpus=0.5"], one_node_of_two)


@pytest.mark.parametrize("learners,runners_without,runners_with", [(0, 7, 5), (2, 5, 1)])
def test_profile_auto_leaves_the_aggregators_cpus_out_of_the_env_runners(learners, runners_without, runners_with):
    """8 CPUs: the main process (1) and the learners (1 each) first, then 2 aggregators per learner, then runners."""
    common = [*APPO, f"scale.learners={learners}"]
    assert plan_for(common, profile="auto").config.scale.env_runners == runners_without
    sized = plan_for([*common, "scale.aggregators_per_learner=2"], profile="auto")
    assert sized.config.scale.env_runners == runners_with
    assert cpus(sized.bundles) <= 8  # and the pre-flight check passed


def test_profile_auto_gives_each_remote_learner_an_aggregator_where_cpus_allow():
    remote = [*APPO, "scale.learners=1"]
    sized = plan_for(remote, SIXTEEN_CORES, profile="auto").config.scale
    assert sized.aggregators_per_learner == 1 and sized.env_runners == 16 - 1 - 1 - 1  # main, learner, aggregator
    assert plan_for(remote, TWO_CORES, profile="auto").config.scale.aggregators_per_learner == 0  # no core to spare
    assert plan_for([*APPO, "scale.learners=0"], SIXTEEN_CORES, profile="auto").config.scale.aggregators_per_learner == 0
    assert plan_for([*remote, "scale.aggregators_per_learner=0"], SIXTEEN_CORES, profile="auto").config.scale.aggregators_per_learner == 0
    assert plan_for(["scale.learners=1"], SIXTEEN_CORES, profile="auto").config.scale.aggregators_per_learner == 0  # PPO


def test_a_given_env_runner_count_is_not_resized_for_the_aggregators():
    with pytest.raises(UserError, match="the run needs 10 CPUs"):
        plan_for([*APPO, "scale.env_runners=7", "scale.aggregators_per_learner=2"], profile="auto")


@pytest.mark.slow
def test_appo_trains_with_an_aggregator_actor(runs):
    """2 cores: main process 0.5 (the learner in it: 0.5), one runner 0.5, one aggregator 1 CPU. The aggregator is seen
    as a process of its own under the run (Ray's process title `ray::AggregatorActor`) while it trains."""
    import psutil

    command = [sys.executable, "-m", "rlplatform", "train", "--runs-dir", str(runs), "--set", "name=aggregators",
               *[arg for item in APPO for arg in ("--set", item)],
               "--set", "stop.iterations=2", "--set", "stop.env_steps=null", "--set", "stop.return_mean=null",
               "--set", "checkpoint.every=0", "--set", "scale.env_runners=1", "--set", "scale.aggregators_per_learner=1",
               "--set", "hardware.driver_cpus=0.5", "--set", "hardware.cpus_per_env_runner=0.5",
               "--set", "hardware.cpus_per_learner=0.5"]  # with the learner in the main process its bundle is the max of both
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    actors: set[str] = set()  # Ray's process titles "ray::<ActorClass>[.method]" of the processes under the run
    deadline = time.time() + 300
    try:
        while proc.poll() is None and time.time() < deadline:
            try:
                children = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:  # the run just ended
                break
            for child in children:
                try:
                    title = (child.cmdline() or [""])[0]
                except psutil.Error:  # ended while it was read
                    continue
                if title.startswith("ray::"):
                    actors.add(title[5:].split(".", 1)[0].split(" ", 1)[0])
            time.sleep(0.25)
    finally:
        if proc.poll() is None:
            proc.kill()
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stdout + stderr
    assert "AggregatorActor" in actors, sorted(actors)
    assert any(name.endswith("EnvRunner") for name in actors), sorted(actors)

    rows = read_metrics(only_run_dir(runs, "aggregators"))
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[-1]["env_steps"] > 0 and rows[-1]["faults/healthy_env_runners"] == 1.0
    # the learner got the aggregator's batches (by the last iteration: an asynchronous first one may end before any
    # batch is trained, on a slow machine)
    assert rows[-1]["throughput/env_steps_trained_per_s"] > 0
    assert "learner/default_policy/policy_loss" in rows[-1], sorted(rows[-1])
