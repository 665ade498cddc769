"""`record:`: a training run writes every episode its env runners sample, in RLlib's offline format.

The quick tests drive a real env runner in this process (RLlib's own, and the lean one with its columnar path) with
fragments much shorter than an episode, so every episode arrives in chunks, and check that what is written is
exactly the chunks joined. The slow ones train through `python -m rlplatform train` with the lean sampler on and off
and compare the recording with the run's own episode count; a BC run reads a recording back.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, only_run_dir, read_metrics, run_cli
from test_offline_train import cli_error, printed_config

from rlplatform.adapter import offline_data, recording
from rlplatform.config.schema import validate

PPO = str(ROOT / "experiments" / "cartpole_ppo.yaml")


def _runner(speedups: bool, path: Path, per_file: int):
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    from rlplatform.adapter.algorithm_config import build_algorithm_config

    config = validate({"algorithm": "PPO", "env": "CartPole-v1", "speedups": speedups, "scale": {"env_runners": 0, "envs_per_runner": 3},
                       "record": {"path": str(path), "episodes_per_file": per_file}})
    algo_config = build_algorithm_config(config, recording=True)
    algo_config.env_runners(rollout_fragment_length=7)
    return (algo_config.env_runner_cls or SingleAgentEnvRunner)(config=algo_config, worker_index=0)


def _joined(chunks: list) -> dict[str, dict[str, list]]:
    """The test's own join of the chunks it was handed, by episode id: observations, actions, rewards."""
    episodes: dict[str, dict[str, list]] = defaultdict(lambda: {"obs": [], "actions": [], "rewards": [], "done": False})
    for chunk in chunks:
        data = episodes[chunk.id_]
        obs = list(np.asarray(chunk.get_observations()))
        data["obs"].extend(obs if not data["obs"] else obs[1:])
        data["actions"].extend(np.asarray(chunk.get_actions()).tolist())
        data["rewards"].extend(np.asarray(chunk.get_rewards()).tolist())
        data["done"] = chunk.is_done
    return {k: v for k, v in episodes.items() if v["done"]}


@pytest.mark.parametrize("speedups", [True, False], ids=["lean", "rllib"])
def test_an_env_runner_writes_each_finished_episode_whole(speedups, tmp_path):
    runner = _runner(speedups, tmp_path, per_file=5)
    chunks = []
    try:
        for _ in range(60):
            chunks.extend(runner.sample(num_timesteps=21))
        recording.flush_this_process()  # what the runner holds below a full file
    finally:
        runner.stop()
    expected = _joined(chunks)
    written = {episode.id_: episode for episode in offline_data.read_episodes(tmp_path)}
    assert len(expected) >= 10 and set(written) == set(expected)
    for id_, episode in written.items():
        assert episode.is_done and episode.t_started == 0 and len(episode) == len(expected[id_]["actions"])
        np.testing.assert_array_equal(episode.get_observations(), np.asarray(expected[id_]["obs"]))
        assert np.asarray(episode.get_actions()).tolist() == expected[id_]["actions"]
        assert np.asarray(episode.get_rewards()).tolist() == expected[id_]["rewards"]
        assert set(episode.extra_model_outputs) >= {"action_logp", "action_dist_inputs"}
    files = sorted(tmp_path.glob("*.parquet"))
    assert all(len(list(offline_data.read_episodes(f))) <= 5 for f in files) and len(files) >= len(written) // 5


def test_the_record_section_is_checked_before_ray_starts(tmp_path, capsys):
    assert "record does not go with an offline algorithm" in cli_error(
        capsys, str(ROOT / "experiments" / "cartpole_bc.yaml"), "--set", "record.path=x")
    assert "record does not go with multi_agent" in cli_error(
        capsys, str(ROOT / "experiments" / "simple_spread_ppo.yaml"), "--set", "record.path=x")
    assert "a directory, not a URI" in cli_error(capsys, PPO, "--set", "record.path=s3://bucket/episodes")
    (tmp_path / "file").write_text("")
    assert "a file, not a directory" in cli_error(capsys, PPO, "--set", f"record.path={tmp_path / 'file'}")
    offline_data.write_part([], tmp_path / "old" / "part.parquet")
    assert "already holds a dataset" in cli_error(capsys, PPO, "--set", f"record.path={tmp_path / 'old'}")
    assert "record.episodes_per_file" in cli_error(capsys, PPO, "--set", "record.episodes_per_file=0")


def test_a_sweep_does_not_record(tmp_path, capsys):
    import ray

    from rlplatform.cli import main

    code = main(["tune", str(ROOT / "experiments" / "cartpole_ppo_tune.yaml"), "--runs-dir", str(tmp_path / "runs"),
                 "--set", "record={}"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "a sweep's trials do not record" in lines[0]
    assert not ray.is_initialized()


def test_a_relative_record_path_is_kept_absolute(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = printed_config(capsys, PPO, "--set", "record.path=episodes")
    assert config["record"]["path"] == str(tmp_path / "episodes")


def _recorded_run(runs: Path, *extra: str) -> tuple[Path, dict, dict]:
    result = run_cli("train", PPO, "--runs-dir", str(runs), "--set", "stop.env_steps=6000", "--set", "record={}",
                     "--set", "record.episodes_per_file=25", *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(runs, "cartpole-ppo")
    dataset = json.loads((run_dir / "episodes" / "dataset.json").read_text())
    return run_dir, dataset, read_metrics(run_dir)[-1]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ("--set", "speedups=true", "--set", "scale.env_runners=2", "--set", "hardware.cpus_per_env_runner=0.5",
     "--set", "hardware.driver_cpus=1"),
    ("--set", "speedups=false", "--set", "scale.env_runners=0"),
], ids=["lean-two-runners", "rllib-local-runner"])
def test_a_run_records_every_episode_its_runners_finished(extra, tmp_path):
    run_dir, dataset, last = _recorded_run(tmp_path / "runs", *extra)
    # PPO samples synchronously: every episode the run counted finished is on disk, and no other
    assert dataset["episodes"] == dataset["finished"] == int(last["episodes/total"])
    assert dataset["env_steps"] <= last["env_steps"] and dataset["source"]["run"] == str(run_dir)
    episodes = list(offline_data.read_episodes(run_dir / "episodes"))
    assert all(episode.get_return() == len(episode) for episode in episodes)  # CartPole: 1 per step, no step lost
    runners = {f.name.split("-")[0] for f in (run_dir / "episodes").glob("*.parquet")}
    assert runners == ({"runner001", "runner002"} if "scale.env_runners=2" in extra else {"runner000"})


@pytest.mark.slow
def test_bc_trains_on_a_runs_recording(tmp_path):
    run_dir, dataset, _ = _recorded_run(tmp_path / "runs")
    result = run_cli("train", str(ROOT / "experiments" / "cartpole_bc.yaml"), "--runs-dir", str(tmp_path / "bc"),
                     "--set", f"data.paths=[{run_dir / 'episodes'}]", "--set", "stop.iterations=2",
                     "--set", "data.updates_per_iteration=2", "--set", "evaluation.episodes=2")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(only_run_dir(tmp_path / "bc", "cartpole-bc"))
    assert metrics[-1]["iteration"] == 2 and metrics[-1]["env_steps"] > 0
