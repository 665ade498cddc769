"""The default experiment really learns: CartPole PPO reaches a 100-episode mean return of 475
within 100k env steps, trained exactly as `python -m rlplatform train` trains it."""

import json

import pytest

from conftest import only_run_dir, read_metrics, run_cli

pytestmark = pytest.mark.slow  # and each test `learning`: trains to a target return


@pytest.mark.learning
def test_default_cartpole_ppo_reaches_475_within_100k_env_steps(runs):
    result = run_cli("train", "--runs-dir", runs, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = only_run_dir(runs, "cartpole-ppo")
    last = read_metrics(run_dir)[-1]
    assert last["return/mean"] >= 475, last
    assert last["env_steps"] <= 100_000, last
    assert "stopped: return/mean" in result.stdout


@pytest.mark.learning
def test_plain_rllib_with_the_speedups_off_learns_to_the_same_target(runs):
    result = run_cli("train", "--runs-dir", runs, "--set", "speedups=false", timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = only_run_dir(runs, "cartpole-ppo")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["speedups"]["active"] == []
    last = read_metrics(run_dir)[-1]
    assert last["return/mean"] >= 475, last
    assert last["env_steps"] <= 100_000, last
