"""Our envs: `envs list`, `envs check` on each, a short training run of each env's experiment
file with remote env runners, multi-agent metrics per policy, and fault injection."""

import pytest
from conftest import ROOT, only_run_dir, read_metrics, run_cli

CHECKS = {
    "rlplatform/CostlySim-v0": "{work_ms: 0.1}",
    "rlplatform/PixelCatch-v0": "{size: 64, frame_stack: 4}",
    "rlplatform/Atari-v0": "{game: ALE/Pong-v5, frame_stack: 4}",
    "rlplatform/Pursuit-v0": "{size: 5}",
    "rlplatform/PettingZooParallel-v0": "{env_module: mpe2.simple_spread_v3, N: 2, max_cycles: 25}",
    "rlplatform/Faulty-v0": "{env: CartPole-v1, crash_probability: 0.0}",
}
QUICK = ["--set", "stop.iterations=1", "--set", "stop.return_mean=null", "--set", "checkpoint.every=1"]


def test_envs_list_shows_ours_and_the_suites():
    result = run_cli("envs", "list")
    assert result.returncode == 0, result.stderr
    for env_id in CHECKS:
        assert env_id in result.stdout
    for suite in ("classic control", "box2d", "atari"):
        assert suite in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("env_id", list(CHECKS))
def test_every_env_passes_envs_check(env_id, ray_head):
    result = run_cli("envs", "check", env_id, "--env-config", CHECKS[env_id], "--steps", "500", "--address", ray_head.address)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4/4 checks passed" in result.stdout
    assert "builds in a remote Ray env runner" in result.stdout


def test_envs_check_refuses_an_env_that_cannot_be_built():
    result = run_cli("envs", "check", "rlplatform/CostlySim-v0", "--env-config", "{work_ms: -1}", "--no-ray")
    assert result.returncode == 2 and "cannot be built" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("experiment,extra", [
    ("pixel_catch_ppo.yaml", ["--set", "training.train_batch_size_per_learner=256", "--set", "training.minibatch_size=64"]),
    ("costly_sim_ppo.yaml", ["--set", "training.train_batch_size_per_learner=400"]),
    ("simple_spread_ppo.yaml", ["--set", "training.train_batch_size_per_learner=400"]),
    ("pong_appo.yaml", ["--set", "scale.envs_per_runner=1"]),  # the `bench gpu` preset, here on CPU
])
def test_env_experiment_trains_with_remote_runners(experiment, extra, ray_head, runs):
    result = run_cli("train", ROOT / "experiments" / experiment, "--address", ray_head.address, "--runs-dir", runs,
                     "--set", "scale.env_runners=1", *QUICK, *extra, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = only_run_dir(runs, next(runs.iterdir()).name)
    last = read_metrics(run_dir)[-1]
    assert last["env_steps"] > 0 and last["faults/healthy_env_runners"] >= 1


@pytest.mark.slow
def test_multi_agent_run_reports_per_policy_metrics_and_its_checkpoint_evaluates(ray_head, runs):
    result = run_cli("train", ROOT / "experiments" / "pursuit_ppo.yaml", "--address", ray_head.address, "--runs-dir", runs,
                     *QUICK, "--set", "training.train_batch_size_per_learner=500", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = only_run_dir(runs, "pursuit-ppo")
    last = read_metrics(run_dir)[-1]
    for policy in ("pursuer", "evader"):
        assert f"return/{policy}/mean" in last, sorted(last)
        assert f"learner/{policy}/policy_loss" in last, sorted(last)
    modules = sorted(p.name for p in (run_dir / "checkpoints" / "checkpoint_000001" / "learner_group" / "learner" / "rl_module").iterdir()
                     if p.is_dir())
    assert modules == ["evader", "pursuer"]
    evaluated = run_cli("evaluate", run_dir, "--episodes", "3")
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    assert "policy pursuer: return" in evaluated.stdout and "policy evader: return" in evaluated.stdout


@pytest.mark.slow
def test_fault_injection_run_finishes_despite_crashes(ray_head, runs):
    """Runner processes die (os._exit) mid-sampling; RLlib restarts them and the run still finishes."""
    result = run_cli("train", ROOT / "experiments" / "cartpole_faults_ppo.yaml", "--address", ray_head.address,
                     "--runs-dir", runs, "--set", "env_config.crash_probability=0.002", "--set", "scale.env_runners=2",
                     "--set", "hardware.cpus_per_env_runner=0.5", "--set", "stop.env_steps=4000",
                     "--set", "stop.return_mean=null", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = read_metrics(only_run_dir(runs, "cartpole-faults-ppo"))
    assert rows[-1]["env_steps"] >= 4000
    assert rows[-1]["faults/env_runner_restarts"] > 0
    assert min(r["faults/healthy_env_runners"] for r in rows) < 2  # the drop is on record
