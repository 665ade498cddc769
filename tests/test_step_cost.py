"""Envs per runner without a bench cache: `--profile auto` measures the env's step cost at start-up
(`rlplatform/config/step_cost.py`). The unit tests build real envs and plans; none starts Ray."""

import json
from types import SimpleNamespace

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


def counting_steps(monkeypatch) -> list[int]:
    """Counts the steps of each env that the measurement builds (the real env, observed, not replaced)."""
    from rlplatform.config import env_ids

    counts, make_env = [], env_ids.make_env

    def make_and_count(env_id, /, **kwargs):
        env = make_env(env_id, **kwargs)
        counts.append(0)
        step, index = env.step, len(counts) - 1

        def counted(action):
            counts[index] += 1
            return step(action)

        env.step = counted
        return env

    monkeypatch.setattr(env_ids, "make_env", make_and_count)
    return counts


def test_a_waiting_or_working_step_is_measured_costlier_than_a_cheap_one_in_wall_time(monkeypatch):
    """Timing-free: only lower bounds (a step that sleeps 40 ms lasts at least 40 ms however loaded the
    machine), and the cheap env against the costly ones of the same machine."""
    steps = counting_steps(monkeypatch)
    cartpole = step_cost.measure_step_cost("CartPole-v1", {})
    waiting = step_cost.measure_step_cost("rlplatform/CostlySim-v0", {"wait_ms": 40.0})
    working = step_cost.measure_step_cost("rlplatform/CostlySim-v0", {"work_ms": 5.0})
    assert 0 < cartpole < working and cartpole < waiting
    assert waiting >= 40e-3  # the sleep counts: a runner waits as long
    assert working >= 5e-3  # CostlySim burns 5 ms of its thread's CPU time, so at least 5 ms of wall time
    assert step_cost.envs_for_step_cost(waiting) == step_cost.envs_for_step_cost(working) == 1
    assert step_cost.envs_for_step_cost(cartpole) >= step_cost.envs_for_step_cost(working)
    # The measurement stops at MEASURE_STEPS or after MEASURE_SECONDS, whichever comes first: CartPole takes
    # at most the steps (and the warm-up), the 40 ms env no more than fit into the time (fewer when loaded).
    most_in_time = step_cost.WARMUP_STEPS + step_cost.MEASURE_SECONDS / 40e-3 + 1
    assert steps[0] <= step_cost.WARMUP_STEPS + step_cost.MEASURE_STEPS
    assert 1 <= steps[1] <= most_in_time < step_cost.MEASURE_STEPS


def test_an_env_that_cannot_be_built_or_stepped_is_measured_as_none():
    assert step_cost.measure_step_cost("rlplatform/CostlySim-v0", {"work_ms": -1.0}) is None
    assert step_cost.measure_step_cost("NoSuchEnv-v0", {}) is None


def test_the_rule_gives_a_power_of_two_within_the_batch_bound():
    assert [step_cost.envs_for_step_cost(s * 1e-6) for s in (5, 13, 20, 50, 100, 400, 790, 801, 5000)] == [64, 32, 32, 16, 8, 2, 2, 1, 1]
    assert step_cost.envs_for_step_cost(5e-6, batch_bound=10) == 8
    assert step_cost.envs_for_step_cost(5e-6, batch_bound=0) == 1


@pytest.fixture
def measured(monkeypatch) -> list[float]:
    """The step costs that plans measured, observed on their way from the real measurement to the rule."""
    seen, apply = [], step_cost.apply_step_cost

    def measure(env, env_config):
        seen.append(step_cost.measure_step_cost(env, env_config))
        return seen[-1]

    monkeypatch.setattr(step_cost, "apply_step_cost", lambda *a, **kw: apply(*a, **kw, measure=measure))
    return seen


@pytest.fixture
def costs(monkeypatch):
    """Plans sized from a given step cost instead of this machine's measurement: `costs.set(seconds)`."""
    given, apply = SimpleNamespace(cost=None), step_cost.apply_step_cost
    monkeypatch.setattr(step_cost, "apply_step_cost", lambda *a, **kw: apply(*a, **kw, measure=lambda env, cfg: given.cost))
    given.set = lambda cost: setattr(given, "cost", cost)
    return given


def test_appo_cartpole_without_scale_gets_its_envs_from_the_measurement(tmp_path, measured):
    plan = plan_for(experiment(tmp_path))
    (cost,) = measured  # measured on this machine, at plan time: whatever it is, the rule maps it
    assert plan.config.scale.env_runners == 1  # one runner beside the learner on 2 cores
    envs = step_cost.envs_for_step_cost(cost, batch_bound=8)  # APPO's batch of 500 / 50-step fragments: at most 8
    assert plan.config.scale.envs_per_runner == plan.envs_choice["envs_per_runner"] == envs
    assert plan.envs_choice["source"] == "step-cost measurement at start-up"
    assert plan.envs_choice["step_cost_us"] == round(cost * 1e6, 2)
    assert plan.envs_note.startswith(f"envs per runner: {envs} (step-cost measurement at start-up: ")


def test_appo_cartpole_at_its_usual_step_cost_gets_the_8_of_its_batch(tmp_path, costs):
    costs.set(10e-6)  # CartPole's step: 5-30 us on the machines seen so far
    plan = plan_for(experiment(tmp_path))
    assert (plan.config.scale.env_runners, plan.config.scale.envs_per_runner) == (1, 8)
    assert plan.envs_choice == {"envs_per_runner": 8, "source": "step-cost measurement at start-up", "step_cost_us": 10.0}
    assert plan.envs_note.startswith("envs per runner: 8 (step-cost measurement at start-up: 10.0 us")


def test_ppo_batch_bounds_the_envs(tmp_path, costs):
    costs.set(5e-6)  # cheap enough for the cap of 64
    big = plan_for(experiment(tmp_path, algorithm="PPO"))  # RLlib's default batch of 4000: the cap
    assert (big.config.scale.env_runners, big.config.scale.envs_per_runner) == (0, 64)
    small = plan_for(experiment(tmp_path, algorithm="PPO", training={"train_batch_size_per_learner": 1000}))
    assert small.config.scale.envs_per_runner == 16  # 1000 / 50 = 20 -> 16
    # PPO's own fragment fixes the envs (RLlib wants runners x envs x fragment = batch): not sized
    fragment = plan_for(experiment(tmp_path, algorithm="PPO", training={"train_batch_size_per_learner": 1000},
                                   scale={"rollout_fragment_length": 250}))
    assert fragment.config.scale.envs_per_runner == 1 and fragment.envs_choice["source"] == "default"


def test_an_asynchronous_algorithms_own_fragment_bounds_the_envs(tmp_path, costs):
    costs.set(5e-6)
    plan = plan_for(experiment(tmp_path, scale={"rollout_fragment_length": 100}))
    assert plan.config.scale.envs_per_runner == 4  # APPO's batch of 500 / 100 = 5 -> 4


def test_an_expensive_env_gets_one_env_and_says_so(tmp_path, measured):
    plan = plan_for(experiment(tmp_path, env="rlplatform/CostlySim-v0", env_config={"wait_ms": 20.0}))
    assert measured[0] >= 20e-3  # the real measurement: a 20 ms sleep lasts at least 20 ms
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
    run_dir = only_run_dir(runs, "measured")
    choice = json.loads((run_dir / "manifest.json").read_text())["envs_per_runner"]
    assert choice["source"] == "step-cost measurement at start-up" and choice["step_cost_us"] > 0
    # whatever this machine measured, the rule sized the run from it (at most APPO's 8 of its batch)
    envs = step_cost.envs_for_step_cost(choice["step_cost_us"] * 1e-6, batch_bound=8)
    assert choice["envs_per_runner"] == envs
    assert f"envs per runner: {envs} (step-cost measurement at start-up: " in measured.stdout
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["scale"]["envs_per_runner"] == envs

    kept = run_cli("train", path, "--profile", "auto", "--runs-dir", runs, "--set", "name=kept",
                   "--set", "scale.envs_per_runner=3", *quick, env=env, timeout=300)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "step-cost measurement" not in kept.stdout
    run_dir = only_run_dir(runs, "kept")
    assert json.loads((run_dir / "manifest.json").read_text())["envs_per_runner"] == {
        "envs_per_runner": 3, "source": "experiment", "step_cost_us": None}
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["scale"]["envs_per_runner"] == 3
