"""`bench ingest`: each role's CPU per env step, from the processes' CPU times and the run's env steps."""

import json

import pytest
from conftest import run_cli

from rlplatform.bench import ingest


def sample(t, machine, **cpu_by_pid):
    roles = {"1": "driver", "2": "algorithm + local learner", "3": "env runner", "4": "env runner", "5": "ray raylet"}
    return {"t": t, "machine_busy_s": machine,
            "processes": {pid: {"role": roles[pid], "node": "driver", "cpu_s": cpu} for pid, cpu in cpu_by_pid.items()}}


def test_role_costs_divide_each_roles_cpu_in_the_window_by_the_env_steps_sampled_in_it():
    metrics = [{"wall_time_s": 10.0, "env_steps": 1_000}, {"wall_time_s": 20.0, "env_steps": 11_000},
               {"wall_time_s": 30.0, "env_steps": 21_000}]
    samples = [
        sample(5.0, 0.0, **{"1": 0.1, "2": 1.0, "3": 1.0}),  # start-up: outside the window
        sample(10.0, 10.0, **{"1": 0.2, "2": 2.0, "3": 2.0, "5": 0.5}),
        sample(30.0, 40.0, **{"1": 0.4, "2": 6.0, "3": 6.0, "4": 2.0, "5": 1.5}),  # runner 4 started in the window
    ]
    costs = ingest.role_costs(samples, metrics, steps_per_fragment=1_600)
    assert costs["env_steps"] == 20_000 and costs["window_s"] == 20.0
    assert costs["us_per_step"] == pytest.approx({"driver": 10.0, "algorithm + local learner": 200.0,
                                                  "env runner": 300.0, "ray": 50.0})
    assert costs["ms_per_fragment"]["env runner"] == pytest.approx(300.0 * 1_600 / 1_000)
    assert costs["processes"] == {"driver": 1, "algorithm + local learner": 1, "env runner": 2, "ray": 1}
    assert costs["cpu_s_total"] == pytest.approx(sum(costs["cpu_s"].values())) and costs["machine_busy_s"] == 30.0
    ceilings = ingest.ceilings(costs["us_per_step"], costs["processes"])
    assert ceilings == pytest.approx({"driver": 100_000.0, "algorithm + local learner": 5_000.0,
                                      "env runner": 2 * 1e6 / 300.0})  # ray's daemons cap nothing: not a pipeline role


def test_the_learners_gradient_cpu_in_the_window_splits_its_cost_into_gradient_and_host_side():
    metrics = [{"wall_time_s": 10.0, "env_steps": 1_000, ingest.GRADIENT_KEY: 1.0},
               {"wall_time_s": 30.0, "env_steps": 21_000, ingest.GRADIENT_KEY: 3.0}]
    samples = [sample(10.0, 10.0, **{"2": 2.0}), sample(30.0, 40.0, **{"2": 6.0})]
    costs = ingest.role_costs(samples, metrics, steps_per_fragment=1_600)
    assert costs["gradient_us_per_step"] == pytest.approx(100.0)  # 2 s of 4 in gradient steps, over 20k env steps
    point = ingest.Point("APPO", 10, 50, 0, 0)  # the learner in the algorithm's process
    assert ingest.learner_host_cost(costs, point) == pytest.approx(100.0)
    assert ingest.learner_host_cost(costs, ingest.Point("APPO", 10, 50, 0, 1)) is None  # no remote learner sampled
    assert ingest.role_costs(samples, [{k: v for k, v in m.items() if k != ingest.GRADIENT_KEY} for m in metrics],
                             1_600)["gradient_us_per_step"] is None  # speed-ups off: RLlib's learner logs none
    gap = [metrics[0], {"wall_time_s": 20.0, "env_steps": 11_000}, metrics[1]]  # an iteration without a learner result
    assert ingest.role_costs(samples, gap, 1_600)["gradient_us_per_step"] == pytest.approx(100.0)


def test_a_window_without_two_samples_or_iterations_gives_none():
    metrics = [{"wall_time_s": 10.0, "env_steps": 1_000}, {"wall_time_s": 12.0, "env_steps": 2_000}]
    assert ingest.role_costs([sample(11.0, 0.0, **{"1": 1.0})], metrics, 100) is None
    assert ingest.role_costs([sample(11.0, 0.0, **{"1": 1.0}), sample(11.5, 1.0, **{"1": 1.1})], metrics[:1], 100) is None


def test_two_fragment_lengths_split_a_roles_cost_into_per_step_and_per_fragment():
    def row(fragment, us_per_step_driver):
        steps_per_fragment = 32 * fragment
        return {"algorithm": "APPO", "episode_len": 10, "aggregators": 0, "learners": 0, "fragment": fragment,
                "steps_per_fragment": steps_per_fragment, "us_per_step": {"driver": us_per_step_driver},
                "ms_per_fragment": {"driver": us_per_step_driver * steps_per_fragment / 1e3}}

    # driver: 2 us per step + 0.3 ms per fragment -> per step 2 + 300 / steps_per_fragment
    rows = [row(50, 2 + 300 / 1_600), row(500, 2 + 300 / 16_000), {"algorithm": "PPO", "error": "failed"}]
    (fit,) = ingest.fit_fragment_costs(rows)
    assert fit["fragments"] == [50, 500]
    assert fit["roles"]["driver"]["us_per_step"] == pytest.approx(2.0)
    assert fit["roles"]["driver"]["ms_per_fragment"] == pytest.approx(0.3)


def test_points_skip_aggregators_for_ppo_and_refuse_bad_counts():
    args = type("Args", (), dict(algorithms=["PPO", "APPO"], episode_lens=[10], fragments=[50], aggregators=[0, 1],
                                 learners=[0], runners=1, envs_per_runner=4, obs_size=4, seconds=5.0, interval=0.5,
                                 cpus=0.5, nodes=0, node_cpus=2.0))()
    assert [(p.algorithm, p.aggregators) for p in ingest._points(args)] == [("PPO", 0), ("APPO", 0), ("APPO", 1)]
    args.fragments = [0]
    with pytest.raises(ingest.UserError, match="--fragments"):
        ingest._points(args)


@pytest.mark.slow
def test_a_short_ingest_run_measures_every_role_and_their_cpu_adds_up(tmp_path):
    result = run_cli("bench", "ingest", "--algorithms", "APPO", "--episode-lens", "10", "--fragments", "25", "50",
                     "--envs-per-runner", "8", "--seconds", "12", "--interval", "0.25", "-o", tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = tmp_path.glob("ingest-*/ingest.json")
    assert (path.parent / "ingest.png").is_file()
    data = json.loads(path.read_text())
    assert [(p["algorithm"], p["fragment"]) for p in data["points"]] == [("APPO", 25), ("APPO", 50)]
    for point in data["points"]:
        assert "error" not in point, point
        assert {"driver", "algorithm + local learner", "env runner", "ray"} <= set(point["us_per_step"]), point
        assert all(cost > 0 for cost in point["us_per_step"].values()), point
        assert point["processes"]["env runner"] == 1 and point["env_steps"] > 0
        # every process of the run is in one role; together they used no more than the whole machine did
        assert point["cpu_s_total"] == pytest.approx(sum(point["cpu_s"].values()))
        assert 0 < point["cpu_s_total"] <= point["machine_busy_s"] * 1.05, point
        assert point["capped_by"] in ingest.PIPELINE_ROLES and point["ceiling_env_steps_per_s"] > 0
        # the local learner's gradient steps are part of the algorithm's process, and less than all of it
        assert 0 < point["gradient_us_per_step"] < point["us_per_step"]["algorithm + local learner"], point
        assert point["learner_host_us_per_step"] > 0
    (fit,) = data["fit"]
    assert fit["fragments"] == [25, 50] and "env runner" in fit["roles"]
    assert "bench ingest" in result.stdout and "capped by" in result.stdout
