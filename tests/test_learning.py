"""The default experiment really learns: CartPole PPO reaches a 100-episode mean return of 475
within 100k env steps, trained exactly as `python -m rlplatform train` trains it, speed-ups on; its ONNX
export reaches the same 100-episode greedy return as its checkpoint.

One training for the module. The speed-ups are checked against plain RLlib without a second training:
the same update (tests/test_lean_learner.py, test_lean_off_policy.py), the same episodes
(test_lean_env_runner.py, test_slim_env_runner.py), and `speedups=false` recorded as plain RLlib
(test_internals.py)."""

import json

import pytest
from conftest import only_run_dir, read_metrics, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.learning]  # trains to a target return


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The default experiment, trained once for this module's tests."""
    runs = tmp_path_factory.mktemp("learning-runs")
    result = run_cli("train", "--runs-dir", runs, timeout=900)
    return result, only_run_dir(runs, "cartpole-ppo")


def test_default_cartpole_ppo_reaches_475_within_100k_env_steps(default_run):
    result, run_dir = default_run
    assert result.returncode == 0, result.stdout + result.stderr
    speedups = json.loads((run_dir / "manifest.json").read_text())["speedups"]
    assert speedups["requested"] and {"lean_env_runner", "lean_learner"} <= set(speedups["active"]), speedups
    last = read_metrics(run_dir)[-1]
    assert last["return/mean"] >= 475, last
    assert last["env_steps"] <= 100_000, last
    assert "stopped: return/mean" in result.stdout


def test_the_onnx_export_of_the_trained_policy_reaches_the_same_100_episode_return(default_run, tmp_path):
    result, run_dir = default_run
    assert result.returncode == 0, result.stdout + result.stderr
    exported = run_cli("export", run_dir, "-o", tmp_path / "policy")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    returns = {}
    for name, target in (("checkpoint", run_dir), ("onnx", tmp_path / "policy")):
        evaluated = run_cli("evaluate", target, "--episodes", "100", "--json", tmp_path / f"{name}.json")
        assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
        returns[name] = json.loads((tmp_path / f"{name}.json").read_text())["returns"]
    assert returns["onnx"] == returns["checkpoint"]
    assert sum(returns["onnx"]) / 100 >= 400  # greedy, the trained policy nearly always balances to the end

