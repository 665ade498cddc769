"""`rlplatform bench throughput`: the raw env limit and real RLlib env runners sampling per layout."""

import json

from conftest import ROOT, assert_user_error, run_cli


def test_throughput_measures_raw_limit_and_each_layout(tmp_path):
    result = run_cli("bench", "throughput", ROOT / "experiments" / "cartpole_ppo.yaml", "--layouts", "1x1", "1x4xasync", "9x1",
                     "--seconds", "1.5", "-o", tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "9x1xsync: skipped, needs 9 CPUs" in result.stdout
    data = json.loads((tmp_path / "throughput-CartPole-v1.json").read_text())
    assert data["raw_env_steps_per_s"] > 1000  # CartPole stepped raw does tens of thousands per second
    layouts = {row["layout"]: row for row in data["layouts"]}
    assert set(layouts) == {"1x1xsync", "1x4xasync"}
    for row in layouts.values():
        assert row["env_steps_per_s"] > 0
        assert row["ratio_to_raw_per_runner"] == row["env_steps_per_s"] / (data["raw_env_steps_per_s"] * row["env_runners"])
    assert (tmp_path / "throughput-CartPole-v1.png").stat().st_size > 5000


def test_bad_layout_is_refused_before_ray_starts(tmp_path):
    assert_user_error(run_cli("bench", "throughput", "--layouts", "2by8", "-o", tmp_path), "--layouts", "2by8")
