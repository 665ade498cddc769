"""Envs per runner without a bench cache: `--profile auto` measures the env's step cost at start-up
(`rlplatform/config/step_cost.py`). The unit tests build real envs and plans; none starts Ray."""

import json
import time

import pytest
import yaml

from conftest import only_run_dir, run_cli
from rlplatform.config import layouts, step_cost
from rlplatform.config.experiment import resolve_experiment
from rlplatform.config.sizing import Resources
from rlplatform.run.plan import make_plan

TWO_CORES = Resources(2, 0, [{"CPU": 2, "GPU": 0}])
NO_SCALE = {"version": 1, "algorithm": "APPO", "env": "CartPole-v1", "seed": 0, "stop": {"iterations": 2}}


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(layouts.CACHE_ENV, str(tmp_path / "cache"))


def experiment(tmp_path, **changes):
    data = {**NO_SCALE, **changes}
    path = tmp_path / "open.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def plan_for(path, overrides=(), profile=None):
    return make_plan(resolve_experiment(path, list(overrides), profile), TWO_CORES, joined_cluster=False, resize=True)


def test_a_cheap_step_is_measured_cheap_and_a_waiting_one_in_wall_time_all_well_under_a_second():
    start = time.perf_counter()
    cartpole = step_cost.measure_step_cost("CartPole-v1", {})
    waiting = step_cost.measure_step_cost("rlplatform/CostlySim-v0", {"wait_ms": 40.0})
    assert time.perf_counter() - start < 1.0
    assert 0 < cartpole < 100e-6  # ~5-10 us here
    assert 40e-3 <= waiting < 80e-3  # the sleep counts: a runner waits as long
    assert step_cost.envs_for_step_cost(cartpole) == step_cost.MAX_ENVS
    assert step_cost.envs_for_step_cost(waiting) == 1
    assert step_cost.envs_for_step_cost(step_cost.measure_step_cost("rlplatform/CostlySim-v0", {"work_ms": 5.0})) == 1


def test_the_rule_gives_a_power_of_two_within_the_batch_bound():
    assert [step_cost.envs_for_step_cost(s * 1e-6) for s in (5, 13, 20, 50, 100, 400, 790, 801, 5000)] == [64, 32, 32, 16, 8, 2, 2, 1, 1]
    assert step_cost.envs_for_step_cost(5e-6, batch_bound=10) == 8
    assert step_cost.envs_for_step_cost(5e-6, batch_bound=0) == 1


def test_appo_cartpole_without_scale_gets_8_envs_from_the_measurement(tmp_path):
    plan = plan_for(experiment(tmp_path))
    # one runner beside the learner on 2 cores; APPO's batch of 500 / 50-step fragments bounds the 64 to 8
    assert (plan.config.scale.env_runners, plan.config.scale.envs_per_runner) == (1, 8)
    assert plan.envs_choice["source"] == "step-cost measurement at start-up"
    assert plan.envs_choice["envs_per_runner"] == 8 and 0 < plan.envs_choice["step_cost_us"] < 100
    assert plan.envs_note.startswith("envs per runner: 8 (step-cost measurement at start-up: ")


def test_ppo_batch_bounds_the_envs(tmp_path):
    big = plan_for(experiment(tmp_path, algorithm="PPO"))  # RLlib's default batch of 4000: the cap
    assert (big.config.scale.env_runners, big.config.scale.envs_per_runner) == (0, 64)
    small = plan_for(experiment(tmp_path, algorithm="PPO", training={"train_batch_size_per_learner": 1000}))
    assert small.config.scale.envs_per_runner == 16  # 1000 / 50 = 20 -> 16
    # PPO's own fragment fixes the envs (RLlib wants runners x envs x fragment = batch): not sized
    fragment = plan_for(experiment(tmp_path, algorithm="PPO", training={"train_batch_size_per_learner": 1000},
                                   scale={"rollout_fragment_length": 250}))
    assert fragment.config.scale.envs_per_runner == 1 and fragment.envs_choice["source"] == "default"


def test_an_asynchronous_algorithms_own_fragment_bounds_the_envs(tmp_path):
    plan = plan_for(experiment(tmp_path, scale={"rollout_fragment_length": 100}))
    assert plan.config.scale.envs_per_runner == 4  # APPO's batch of 500 / 100 = 5 -> 4


def test_an_expensive_env_gets_one_env_and_says_so(tmp_path):
    plan = plan_for(experiment(tmp_path, env="rlplatform/CostlySim-v0", env_config={"wait_ms": 20.0}))
    assert plan.config.scale.envs_per_runner == 1
    assert plan.envs_choice["source"] == "step-cost measurement at start-up" and plan.envs_choice["step_cost_us"] >= 20_000


@pytest.mark.parametrize("how", ["file", "set", "profile"])
def test_an_explicit_value_stays(tmp_path, how):
    if how == "file":
        plan = plan_for(experiment(tmp_path, scale={"envs_per_runner": 3}))
    elif how == "set":
        plan = plan_for(experiment(tmp_path), ["scale.envs_per_runner=3"])
    else:
        profile = tmp_path / "three.yaml"
        profile.write_text("scale: {envs_per_runner: 3}\n")
        plan = plan_for(experiment(tmp_path), profile=str(profile))
        assert plan.config.profile != "auto"  # a profile file is not `auto`: nothing is sized or measured
    assert plan.config.scale.envs_per_runner == 3 and plan.envs_note is None
    assert plan.envs_choice == {"envs_per_runner": 3, "source": "experiment", "step_cost_us": None}


def test_the_bench_cache_keeps_priority_over_the_measurement(tmp_path):
    rows = [{"env_runners": 1, "envs_per_runner": 4, "vectorize": "sync", "env_steps_per_s": 9000.0}]
    layouts.record(TWO_CORES.cpus, TWO_CORES.gpus, "CartPole-v1", {}, rows, tmp_path / "bench.json")
    plan = plan_for(experiment(tmp_path))
    assert plan.config.scale.envs_per_runner == 4 and plan.layout_note and plan.envs_note is None
    assert plan.envs_choice == {"envs_per_runner": 4, "source": "bench throughput cache", "step_cost_us": None}


def test_an_env_that_cannot_be_built_keeps_one_env_quietly(tmp_path):
    plan = plan_for(experiment(tmp_path, env="rlplatform/CostlySim-v0", env_config={"work_ms": -1.0}))
    assert plan.config.scale.envs_per_runner == 1 and plan.envs_note is None
    assert plan.envs_choice["source"] == "default"


def test_off_policy_algorithms_are_not_sized(tmp_path):
    plan = plan_for(experiment(tmp_path, algorithm="DQN"))
    assert plan.config.scale.envs_per_runner == 1 and plan.envs_choice["source"] == "default"


@pytest.mark.slow
def test_train_records_the_measured_choice_and_keeps_an_explicit_one(tmp_path):
    path = experiment(tmp_path, stop={"iterations": 1}, checkpoint={"every": 0})
    env = {layouts.CACHE_ENV: str(tmp_path / "empty-cache")}
    runs = tmp_path / "runs"
    quick = ["--set", "rllib.reporting.min_time_s_per_iteration=1"]  # APPO's iterations last 10 s otherwise
    measured = run_cli("train", path, "--profile", "auto", "--runs-dir", runs, "--set", "name=measured", *quick, env=env,
                       timeout=300)
    assert measured.returncode == 0, measured.stdout + measured.stderr
    assert "envs per runner: 8 (step-cost measurement at start-up: " in measured.stdout
    run_dir = only_run_dir(runs, "measured")
    choice = json.loads((run_dir / "manifest.json").read_text())["envs_per_runner"]
    assert choice["envs_per_runner"] == 8 and choice["source"] == "step-cost measurement at start-up"
    assert 0 < choice["step_cost_us"] < 100
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["scale"]["envs_per_runner"] == 8

    kept = run_cli("train", path, "--profile", "auto", "--runs-dir", runs, "--set", "name=kept",
                   "--set", "scale.envs_per_runner=3", *quick, env=env, timeout=300)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "step-cost measurement" not in kept.stdout
    run_dir = only_run_dir(runs, "kept")
    assert json.loads((run_dir / "manifest.json").read_text())["envs_per_runner"] == {
        "envs_per_runner": 3, "source": "experiment", "step_cost_us": None}
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["scale"]["envs_per_runner"] == 3
