"""`rlplatform bench`: throughput (and the layout cache `--profile auto` reads), solve, soak, gpu.

Every verb runs the real thing: real RLlib env runners, real `train` processes on a private Ray instance.
"""

import json
import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, assert_user_error, read_metrics, run_cli
from multinode import alive

from rlplatform.infra.loopback import CLUSTER_RAY_ENV

DEFAULT = ROOT / "experiments" / "cartpole_ppo.yaml"
CPUS = len(os.sched_getaffinity(0))  # what a private local Ray instance gets on this machine


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.slow
def test_throughput_measures_raw_limit_and_each_layout_and_auto_uses_the_best(tmp_path):
    cache = {"RLPLATFORM_CACHE_DIR": str(tmp_path / "cache")}
    too_big = f"{CPUS + 1}x1"  # one env runner (1 CPU each) more than this machine has CPUs
    result = run_cli("bench", "throughput", DEFAULT, "--layouts", "1x1", "1x4xasync", "1x16", too_big,
                     "--seconds", "1.5", "-o", tmp_path, timeout=300, env=cache)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{too_big}xsync: skipped, needs {CPUS + 1} CPUs and the cluster has {CPUS}" in result.stdout
    data = json.loads((tmp_path / "throughput-CartPole-v1.json").read_text())
    assert data["raw_env_steps_per_s"] > 1000  # CartPole stepped raw does tens of thousands per second
    layouts = {row["layout"]: row for row in data["layouts"]}
    assert set(layouts) == {"1x1xsync", "1x4xasync", "1x16xsync"}
    for row in layouts.values():
        assert row["env_steps_per_s"] > 0
        assert row["ratio_to_raw_per_runner"] == row["env_steps_per_s"] / (data["raw_env_steps_per_s"] * row["env_runners"])
        # The runners' own CPU (their processes' threads, Ray's included): some per step, and no more than this
        # machine's cores give over the window.
        assert 0 < row["runner_cpu_us_per_step"] < 1e6 * CPUS / row["env_steps_per_s"] * 1.05
        assert row["ratio_to_raw_per_runner_cpu"] == pytest.approx(1e6 / row["runner_cpu_us_per_step"] / data["raw_env_steps_per_s"])
        # Raw stepping timed in the runner's own process: a CPU cost per step of the same order as the driver's raw
        # figure (the same env on the same machine), not a wall-clock or a per-vector-step figure.
        assert 0.2 < row["raw_cpu_us_per_step_in_runner"] * data["raw_env_steps_per_s"] / 1e6 < 5
        if row["vectorize"] == "async":  # its envs step in subprocesses, which the runner's own CPU leaves out
            assert row["ratio_to_raw_in_runner"] is None
        else:
            assert row["ratio_to_raw_in_runner"] == pytest.approx(row["raw_cpu_us_per_step_in_runner"] / row["runner_cpu_us_per_step"])
    assert (tmp_path / "throughput-CartPole-v1.png").stat().st_size > 5000

    best = max(layouts.values(), key=lambda r: r["env_steps_per_s"])
    open_layout = yaml.safe_load(DEFAULT.read_text())
    for key in ("envs_per_runner", "vectorize"):
        del open_layout["scale"][key]
    (tmp_path / "open_layout.yaml").write_text(yaml.safe_dump(open_layout))
    printed = run_cli("train", tmp_path / "open_layout.yaml", "--print-config", env=cache)
    assert printed.returncode == 0, printed.stderr
    scale = yaml.safe_load(printed.stdout)["scale"]
    assert (scale["envs_per_runner"], scale["vectorize"]) == (best["envs_per_runner"], best["vectorize"])
    # What the experiment file or --set gives stays; so does the layout of an experiment never measured.
    own = yaml.safe_load(DEFAULT.read_text())["scale"]
    kept = yaml.safe_load(run_cli("train", "--print-config", env=cache).stdout)["scale"]
    assert (kept["envs_per_runner"], kept["vectorize"]) == (own["envs_per_runner"], own["vectorize"])
    fixed = run_cli("train", tmp_path / "open_layout.yaml", "--print-config", "--set", "scale.envs_per_runner=3", env=cache)
    assert yaml.safe_load(fixed.stdout)["scale"]["envs_per_runner"] == 3
    fresh = run_cli("train", tmp_path / "open_layout.yaml", "--print-config", env={"RLPLATFORM_CACHE_DIR": str(tmp_path / "empty")})
    # No cached layout: the env's step cost measured at start-up (CartPole: the cap of 64, bounded by the
    # batch of 1000 in 50-step fragments to 16; rlplatform/config/step_cost.py)
    assert yaml.safe_load(fresh.stdout)["scale"]["envs_per_runner"] == 16


@pytest.mark.slow
def test_solve_reports_each_seed_and_the_median_with_startup_apart(tmp_path):
    result = run_cli("bench", "solve", "--seeds", "2", "--set", "stop.return_mean=40", "--set", "checkpoint.every=0",
                     "-o", tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = tmp_path.glob("solve-cartpole-ppo-*/solve.json")
    data = json.loads(path.read_text())
    assert [s["seed"] for s in data["seeds"]] == [0, 1]
    for seed in data["seeds"]:
        assert seed["solved"], seed
        startup = seed["startup"]
        assert 0 < startup["ray_ready_s"] <= startup["algorithm_ready_s"] <= startup["first_sample_s"] <= seed["time_to_solve_s"]
        assert 0 < seed["env_steps_to_solve"] <= 100_000
        assert seed["layout"].endswith("x8xsync") and seed["layout_from_bench"] is None  # the file's 8 envs, sync
        assert seed["envs_per_runner"] == {"envs_per_runner": 8, "source": "experiment", "step_cost_us": None}
        assert read_metrics(ROOT / seed["run_dir"])[-1]["return/mean"] >= 40
    times = sorted(s["time_to_solve_s"] for s in data["seeds"])
    assert data["median"]["time_to_solve_s"] == sum(times) / 2
    assert "median" in result.stdout


@pytest.mark.slow
def test_soak_reads_memory_of_driver_algorithm_and_runner(tmp_path):
    # 30 s: on a loaded host the env runner's process has been seen to start 12 s in, and its growth needs six
    # samples after the 9 s warm-up.
    result = run_cli("bench", "soak", "--minutes", "0.5", "--warmup-minutes", "0.15", "--interval", "2",
                     "--set", "scale.env_runners=1", "--set", "scale.algorithm_in=actor", "-o", tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = tmp_path.glob("soak-cartpole-ppo-*/soak.json")
    data = json.loads(path.read_text())
    roles = {p["role"] for p in data["processes"]}
    assert {"driver", "algorithm + local learner", "env runner", "system monitor", "ray gcs server", "ray raylet"} <= roles, roles
    for p in data["processes"]:
        if p["role"] != "other":
            assert p["growth"] is not None and p["rss_after_warmup_mb"] > 10, p
    assert data["worst_growth"] == max(p["growth"] for p in data["processes"] if p["growth"] is not None)
    assert (path.parent / "soak.png").stat().st_size > 5000
    assert "worst growth" in result.stdout


@pytest.mark.slow
@pytest.mark.cluster
def test_soak_on_a_loopback_cluster_reads_every_process_of_every_node(tmp_path):
    result = run_cli("bench", "soak", "--nodes", "2", "--node-cpus", "2", "--minutes", "0.35", "--warmup-minutes", "0.15",
                     "--interval", "2", "--set", "scale.env_runners=2", "--set", "scale.placement=spread",
                     "-o", tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = tmp_path.glob("soak-cartpole-ppo-*/soak.json")
    data = json.loads(path.read_text())
    assert data["nodes"] == 2 and data["cluster_ray_env"] == CLUSTER_RAY_ENV
    found = {(p["role"], p["node"]) for p in data["processes"]}
    assert {("driver", "driver"), ("ray gcs server", "head"), ("ray dashboard", "head"), ("ray raylet", "head"),
            ("ray raylet", "worker 1"), ("env runner", "worker 1"), ("ray dashboard agent", "worker 1")} <= found, found
    assert data["worst_growth"] == max(p["growth"] for p in data["processes"] if p["growth"] is not None)
    pids = [p["pid"] for p in data["processes"]]
    deadline = time.time() + 20  # SIGKILLed processes take a moment to go
    while any(map(alive, pids)) and time.time() < deadline:
        time.sleep(0.5)
    assert not any(map(alive, pids)), "the soak left a process of its cluster running"


def refused_side_by_side(cases: list, tmp_path: Path) -> None:
    """Each (arguments, fragments of the one error line) in its own `bench` process, a CPU each at a time."""
    with ThreadPoolExecutor(max_workers=max(2, CPUS)) as pool:
        results = list(pool.map(lambda case: run_cli("bench", *case[0]), cases))
    for (_, fragments), result in zip(cases, results):
        assert_user_error(result, *fragments)
    assert not list(tmp_path.iterdir())


def test_bad_bench_input_is_refused_before_ray_starts(tmp_path):
    refused_side_by_side([
        (["throughput", "--layouts", "2by8", "-o", tmp_path], ["--layouts", "2by8"]),
        (["solve", "--seeds", "0", "-o", tmp_path], ["--seeds"]),
        (["soak", "--minutes", "1", "--warmup-minutes", "2", "-o", tmp_path], ["--warmup-minutes"]),
        (["soak", "--nodes", "1", "-o", tmp_path], ["--nodes"]),
        (["learner", "--rounds", "0", "-o", tmp_path], ["--rounds"]),
        (["scale", "--runners", "0", "-o", tmp_path], ["--runners"]),
        (["scale", "--address", "127.0.0.1:6379", "-o", tmp_path], ["--address"]),  # not offered: it reads local processes
        (["scale", "--nodes", "1", "-o", tmp_path], ["--nodes"]),  # a head and at least one worker, as for soak
        (["scale", "--runners", "5000", "-o", tmp_path], ["5000 runners do not fit"]),
        (["scale", "--fit", tmp_path / "none.json", "-o", tmp_path / "fit"], ["none.json"]),
    ], tmp_path)


@pytest.mark.slow  # each process imports RLlib to check the experiment (about 4 s each on 2 cores)
def test_a_bad_experiment_for_bench_is_refused_before_ray_starts(tmp_path):
    refused_side_by_side([
        (["solve", "--set", "stop.return_mean=null", "-o", tmp_path], ["stop.return_mean"]),
        (["solve", "--set", "training.lrr=1", "-o", tmp_path], ["training.lrr"]),
        (["learner", ROOT / "experiments" / "cartpole_appo.yaml", "-o", tmp_path], ["cartpole-appo is APPO"]),
        (["learner", DEFAULT, "--ways", "lean", "torch", "-o", tmp_path], ["--ways torch", "not PPO"]),
        (["learner", ROOT / "experiments" / "cartpole_dqn.yaml", "--ways", "sb3", "--sb3-python", tmp_path / "none",
          "-o", tmp_path], ["--sb3-python", "cannot run it"]),
    ], tmp_path)


@pytest.mark.slow  # RLlib learners built and timed in a `bench learner` process, three times
@pytest.mark.parametrize("experiment", ["cartpole_dqn", "pendulum_sac", "cartpole_ppo"])
def test_learner_bench_times_the_lean_rllib_and_plain_torch_updates(tmp_path, experiment):
    result = run_cli("bench", "learner", ROOT / "experiments" / f"{experiment}.yaml", "--seconds", "0.6", "--rounds", "1",
                     "--warmup", "2", "--set", "model.hidden=[32,32]", "-o", tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = tmp_path.glob("learner-*/learner.json")
    data = json.loads(path.read_text())
    rows = {r["way"]: r for r in data["results"]}
    ppo = experiment == "cartpole_ppo"
    assert set(rows) == ({"lean", "rllib"} if ppo else {"lean", "rllib", "torch"}) and data["torch_threads"] == 1
    for r in rows.values():
        assert r["updates"] > 0 and r["ms_per_update"] == pytest.approx(1000 * r["seconds"] / r["updates"], rel=1e-3)
        if not ppo:
            assert r["of_plain_torch"] == pytest.approx(r["updates_per_s"] / rows["torch"]["updates_per_s"])
    if ppo:
        assert data["updates_per_learner_call"] == 1 and data["update"].startswith("20 epoch(s) over a batch of 1000")
    else:
        assert data["updates_per_learner_call"] == updates_per_training_step(experiment, "model.hidden=[32,32]")


def sb3_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("stable_baselines3") is not None


@pytest.mark.slow  # a `bench learner` process and SB3's own beside it, three times
@pytest.mark.skipif(not sb3_installed(), reason="stable-baselines3 is not installed here (pip install -e '.[bench]')")
@pytest.mark.parametrize("experiment", ["cartpole_dqn", "halfcheetah_sac", "cartpole_ppo"])
def test_learner_bench_times_sb3s_own_update_beside_ours(tmp_path, experiment):
    result = run_cli("bench", "learner", ROOT / "experiments" / f"{experiment}.yaml", "--seconds", "1", "--rounds", "2",
                     "--warmup", "2", "--ways", "lean", "sb3", "--set", "model.hidden=[32,32]", "-o", tmp_path,
                     timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = tmp_path.glob("learner-*/learner.json")
    data = json.loads(path.read_text())
    rows = {r["way"]: r for r in data["results"]}
    assert set(rows) == {"lean", "sb3"} and rows["sb3"]["updates"] > 0 and rows["sb3"]["of_sb3"] == 1
    assert rows["lean"]["of_sb3"] == pytest.approx(rows["lean"]["updates_per_s"] / rows["sb3"]["updates_per_s"])
    # SB3 built the experiment's widths: its policy's description names 32-unit layers and no 64- or 256-unit one.
    assert data["sb3"]["sb3"] and "out_features=32" in data["sb3"]["policy"]
    assert "out_features=256" not in data["sb3"]["policy"] and "out_features=64" not in data["sb3"]["policy"]


def updates_per_training_step(experiment: str, *overrides: str) -> int:
    from ray.rllib.algorithms.dqn.dqn import calculate_rr_weights

    from rlplatform.adapter.algorithm_config import build_algorithm_config
    from rlplatform.config.experiment import resolve_experiment

    config = resolve_experiment(ROOT / "experiments" / f"{experiment}.yaml", list(overrides), "laptop").config
    return calculate_rr_weights(build_algorithm_config(config))[1]


@pytest.mark.skipif(has_cuda(), reason="this machine has a GPU: there `rlplatform bench gpu` runs the preset for real")
def test_gpu_preset_refuses_a_machine_without_gpu(tmp_path):
    assert_user_error(run_cli("bench", "gpu", "-o", tmp_path), "needs a GPU", "--profile laptop")


@pytest.mark.slow
def test_gpu_preset_without_a_gpu_learner_measures_the_cpu_baseline(tmp_path):
    # The laptop profile keeps the learner on the CPU: the same Pong APPO learner, measured the same way.
    result = run_cli("bench", "gpu", "--profile", "laptop", "--minutes", "0.4", "--warmup-minutes", "0.15",
                     "--set", "scale.envs_per_runner=1", "--set", "training.train_batch_size_per_learner=100",
                     "-o", tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = tmp_path.glob("gpu-pong-appo-*/gpu.json")
    data = json.loads(path.read_text())
    assert data["learner_device"] == "CPU" and data["layout"] == "1x1xsync"
    assert data["iterations_measured"] >= 1
    assert data["env_steps_sampled_per_s"] > 0 and data["env_steps_trained_per_s"] > 0, data
    if shutil.which("nvidia-smi") is None:
        assert data["gpu_util_percent"] is None  # no GPU, no reading
    else:  # the system panel reads every GPU of the machine, used by the run or not
        assert data["gpu_util_percent"] is not None and 0 <= data["gpu_util_percent"] <= 100
    assert "learner on the CPU" in result.stdout


@pytest.mark.slow
@pytest.mark.cluster
def test_scale_measures_waiting_runners_over_a_loopback_node_and_fits_the_cost_model(tmp_path):
    # Through relays (one per runner here) and with a remote learner, as the cluster model's points are measured.
    relays = ["--set", "scale.runners_per_relay=1", "--set", "scale.learners=1", "--set", "hardware.cpus_per_learner=0.25",
              "--set", "hardware.driver_cpus=0.25"]
    result = run_cli("bench", "scale", "--runners", "2", "4", "--nodes", "2", "--node-cpus", "2", "--iterations", "2",
                     "--fragments", "10", "--wait-ms", "50", "--interval", "1", *relays, "-o", tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = tmp_path.glob("scale-costly-sim-ppo-*/scale.json")
    assert (path.parent / "scale.png").is_file()
    data = json.loads(path.read_text())
    assert data["nodes"] == 2 and data["wait_ms"] == 50 and data["runner_cpus"] > 0
    assert [p["runners"] for p in data["points"]] == [2, 4]
    for point in data["points"]:
        assert "error" not in point, point
        assert point["ideal_env_steps_per_s"] == point["runners"] * 20
        assert 0.3 < point["of_ideal"] <= 1.05, point  # a waiting env cannot step faster than its clock
        assert point["env_steps_per_iteration"] == point["runners"] * 10
        assert point["sample_s"] >= point["env_time_s"] * 0.95 and point["learn_s"] > 0 and point["sync_weights_s"] > 0
        assert point["broadcast_s"] >= point["sync_weights_s"] and point["object_store_mb_per_iteration"] >= 0
        assert point["runner_processes"] == point["runners"] and "worker 1" in point["runner_nodes"]
        assert 0 < point["runner_uss_mb"] < point["runner_rss_mb"]
        assert len(point["runner_memory"]) == point["runners"]  # every runner's own RSS and USS
        assert all(0 < r["uss_mb"] < r["rss_mb"] for r in point["runner_memory"])
        assert {"driver", "algorithm + local learner", "env runner", "relay", "learner", "ray"} <= set(point["cpu_percent"]), point
        assert (point["relays"], point["learners"]) == (point["runners"], 1)
        assert all(v > 0 for v in point["cpu_s_per_iteration"].values()), point["cpu_s_per_iteration"]
        assert 0 < point["startup_first_sample_s"] < 300
        # Every iteration's own times (RLlib smooths its timers; the run's tags must not be smoothed):
        (metrics,) = Path(point["run_dir"]).glob("metrics.jsonl")
        for row in map(json.loads, metrics.read_text().splitlines()):
            assert row["time/sample_s"] + row["time/learn_s"] <= row["time/iteration_s"] + 0.01, row
    # The stores' counters are read once per iteration: with 2 iterations of small objects one point may see no growth.
    assert max(point["object_store_mb_per_iteration"] for point in data["points"]) > 0
    assert "gather s" in result.stdout and "runner USS MB" in result.stdout
    fit = run_cli("bench", "scale", "--fit", path, "-o", tmp_path)
    assert fit.returncode == 0, fit.stdout + fit.stderr
    model = json.loads((tmp_path / "scale-fit.json").read_text())
    assert model["points"] == 2 and [r["runners"] for r in model["extrapolation"]] == [256, 1000]
    assert "d: per MB per runner (s)" in model["left_out"]  # one model: nothing to tell the broadcast's cost apart
    assert "2 needed" in model["cluster"]["direct"]["left_out"]
    cluster = model["cluster"]["relays"]  # as many relays as runners: their costs cannot be told apart
    assert cluster["points"] == 2 and cluster["measured_runners_per_relay"] == [1]
    assert cluster["relay"]["coefficients"]["e: per relay (s)"] > 0
    assert [r["runners"] for r in cluster["extrapolation"]] == [256, 1000]
    assert all(0 < r["sync_of_ideal"] < 1 and r["relays"] == math.ceil(r["runners"] / 32) for r in cluster["extrapolation"])
    assert "cluster model" in fit.stdout


@pytest.mark.slow
def test_offline_bench_measures_ours_and_rllibs_example_settings_on_the_same_data(tmp_path):
    from episodes import cartpole_expert, play

    from rlplatform.adapter import offline_data

    offline_data.write_part(play("CartPole-v1", 6, cartpole_expert), tmp_path / "data" / "part.parquet")
    result = run_cli("bench", "offline", ROOT / "experiments" / "cartpole_bc.yaml", "--iterations", "1",
                     "--set", f"data.paths=[{tmp_path / 'data'}]", "--set", "data.updates_per_iteration=2",
                     "--set", "training.train_batch_size_per_learner=256", "-o", tmp_path / "bench", timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (path,) = (tmp_path / "bench").rglob("offline.json")
    rows = {r["way"]: r for r in json.loads(path.read_text())["results"]}
    assert set(rows) == {"ours", "rllib"}
    for row in rows.values():  # a measured iteration is the experiment's 2 updates of 256 recorded env steps
        assert row["samples"] == 2 * 256 and row["updates"] == 2 and row["samples_per_s"] > 0
    assert rows["ours"]["prelearner_cpus"] == 0 and rows["rllib"]["prelearner_actors"] == 2
    assert rows["ours"]["of_ours"] == 1.0
