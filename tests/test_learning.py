"""The default experiment really learns: CartPole PPO reaches a 100-episode mean return of 475
within 100k env steps, trained exactly as `python -m rlplatform train` trains it."""

import json

import pytest

from conftest import only_run_dir, run_cli


@pytest.mark.learning
def test_default_cartpole_ppo_reaches_475_within_100k_env_steps(runs):
    result = run_cli("train", "--runs-dir", runs, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = only_run_dir(runs, "cartpole-ppo")
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["return/mean"] >= 475, last
    assert last["env_steps"] <= 100_000, last
    assert "stopped: return/mean" in result.stdout
