"""Offline datasets: episodes written and read in RLlib's offline format, `data info`, `record`.

The quick tests build real RLlib episodes from a real CartPole in this process (no Ray); the slow ones
train a tiny run, record its policy playing, and read the recording with RLlib's own reader.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, assert_user_error, only_run_dir, read_metrics, run_cli
from episodes import play

from rlplatform.adapter import offline_data


def cartpole_episodes(count: int, seed: int = 0) -> list:
    """Whole CartPole episodes of random actions."""
    return play("CartPole-v1", count, seed=seed)


def test_episodes_come_back_as_they_were_written(tmp_path):
    episodes = cartpole_episodes(5)
    assert offline_data.write_part(episodes, tmp_path / "data" / "part.parquet") == 5
    back = list(offline_data.read_episodes(tmp_path / "data"))
    assert [e.id_ for e in back] == [e.id_ for e in episodes]
    for a, b in zip(episodes, back):
        np.testing.assert_array_equal(np.asarray(a.get_observations()), np.asarray(b.get_observations()))
        np.testing.assert_array_equal(np.asarray(a.get_actions()), np.asarray(b.get_actions()))
        np.testing.assert_array_equal(np.asarray(a.get_rewards()), np.asarray(b.get_rewards()))
        np.testing.assert_array_equal(np.asarray(a.get_extra_model_outputs("action_logp")),
                                      np.asarray(b.get_extra_model_outputs("action_logp")))
        assert (b.is_terminated, b.is_truncated, len(b)) == (a.is_terminated, a.is_truncated, len(a))
        assert b.observation_space == a.observation_space and b.action_space == a.action_space


def test_rllibs_reader_decodes_the_rows():
    """The row form RLlib's OfflinePreLearner decodes (offline_prelearner.py: msgpack + msgpack_numpy, from_state)."""
    import msgpack
    import msgpack_numpy
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    (episode,) = cartpole_episodes(1)
    decoded = SingleAgentEpisode.from_state(msgpack.unpackb(offline_data.encode(episode), object_hook=msgpack_numpy.decode))
    assert decoded.id_ == episode.id_ and decoded.get_return() == episode.get_return()


def test_an_unfinished_episode_is_not_written(tmp_path):
    (episode,) = cartpole_episodes(1)
    episode.is_terminated = episode.is_truncated = False
    with pytest.raises(ValueError, match="not finished"):
        offline_data.write_part([episode], tmp_path / "part.parquet")
    assert not (tmp_path / "part.parquet").exists()


def test_data_info_reports_what_the_dataset_holds(tmp_path, capsys):
    from rlplatform.cli import main

    episodes = cartpole_episodes(7)
    offline_data.write_part(episodes[:4], tmp_path / "data" / "a.parquet")
    offline_data.write_part(episodes[4:], tmp_path / "data" / "sub" / "b.parquet")
    code = main(["data", "info", str(tmp_path / "data"), "--json", str(tmp_path / "info.json")])  # the CLI's entry point
    result = capsys.readouterr()
    assert code == 0, result
    figures = json.loads((tmp_path / "info.json").read_text())
    returns = [e.get_return() for e in episodes]
    assert figures["episodes"] == figures["finished"] == 7
    assert figures["env_steps"] == sum(len(e) for e in episodes)
    assert figures["return_mean"] == pytest.approx(np.mean(returns))
    assert (figures["return_min"], figures["return_max"]) == (min(returns), max(returns))
    assert figures["observation_space"]["type"] == "Box" and figures["observation_space"]["shape"] == [4]
    assert figures["action_space"] == {"type": "Discrete", "n": 2, "start": 0}
    assert figures["files"] == 2
    assert figures["bytes"] == sum(p.stat().st_size for p in (tmp_path / "data").rglob("*.parquet"))
    assert "7 episodes" in result.out and f"{sum(len(e) for e in episodes):,} env steps" in result.out


def data_info_error(capsys, path: Path) -> str:
    """`data info PATH` run in this process (the CLI's own entry point): exit code 2 and one line `error: ...`."""
    from rlplatform.cli import main

    code = main(["data", "info", str(path)])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), captured
    return lines[0]


def test_data_info_refuses_what_is_not_a_dataset(tmp_path, capsys):
    assert "no such dataset" in data_info_error(capsys, tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert "no Parquet files" in data_info_error(capsys, tmp_path / "empty")
    pq.write_table(pa.table({"obs": [1.0, 2.0]}), tmp_path / "other.parquet")
    assert "no 'item' column" in data_info_error(capsys, tmp_path / "other.parquet")
    (tmp_path / "torn.parquet").write_bytes(b"PAR1 not really")
    assert "not a readable Parquet file" in data_info_error(capsys, tmp_path / "torn.parquet")
    pq.write_table(pa.table({"item": [b"\x00\x01"]}), tmp_path / "junk.parquet")
    assert "not a packed episode" in data_info_error(capsys, tmp_path / "junk.parquet")


ONE_ITERATION = ("--set", "stop.iterations=1", "--set", "stop.return_mean=null", "--set", "stop.env_steps=null",
                 "--set", "scale.env_runners=0", "--set", "training.num_epochs=1")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("record-runs")
    result = run_cli("train", "--runs-dir", runs, *ONE_ITERATION, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return only_run_dir(runs, "cartpole-ppo")


@pytest.mark.slow
@pytest.mark.parametrize("stochastic", [False, True])
def test_record_writes_a_trained_policys_episodes_and_their_description(trained_run, tmp_path, stochastic):
    out = tmp_path / "dataset"
    flags = ["--stochastic"] if stochastic else []
    result = run_cli("record", trained_run, "-o", out, "--episodes", "6", "--seed", "3", *flags, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    dataset = json.loads((out / "dataset.json").read_text())
    episodes = list(offline_data.read_episodes(out))
    assert dataset["episodes"] == len(episodes) == 6 and all(e.is_done for e in episodes)
    assert dataset["env_steps"] == sum(len(e) for e in episodes)
    assert dataset["env"] == "CartPole-v1" and dataset["format"]["column"] == "item"
    assert dataset["source"]["actions"] == ("stochastic" if stochastic else "greedy")
    assert dataset["source"]["checkpoint"].startswith(str(trained_run.resolve()))
    # RLlib's env runner recorded them: module outputs beside each action (the log-probability PPO needs).
    assert all(len(e.get_extra_model_outputs("action_logp")) == len(e) for e in episodes)
    # The same seed plays the same episodes again.
    again = tmp_path / "again"
    assert run_cli("record", trained_run, "-o", again, "--episodes", "6", "--seed", "3", *flags, timeout=300).returncode == 0
    assert [len(e) for e in offline_data.read_episodes(again)] == [len(e) for e in episodes]


@pytest.mark.slow
def test_record_plays_an_export_as_evaluate_does(trained_run, tmp_path):
    """An export plays with onnxruntime alone: the same seed gives `evaluate`'s episodes, recorded."""
    export = tmp_path / "export"
    assert run_cli("export", trained_run, "-o", export, timeout=300).returncode == 0
    evaluated = run_cli("evaluate", export, "--episodes", "4", "--seed", "5", "--json", tmp_path / "eval.json", timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr
    result = run_cli("record", export, "-o", tmp_path / "data", "--episodes", "4", "--seed", "5", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    episodes = list(offline_data.read_episodes(tmp_path / "data"))
    assert [e.get_return() for e in episodes] == json.loads((tmp_path / "eval.json").read_text())["returns"]
    dataset = json.loads((tmp_path / "data" / "dataset.json").read_text())
    assert dataset["source"]["export"] == str(export.resolve()) and dataset["source"]["actions"] == "greedy"
    assert_user_error(run_cli("record", export, "-o", tmp_path / "x", "--stochastic", timeout=120), "exported greedy")


@pytest.mark.slow
def test_record_keeps_what_is_there_and_refuses_bad_input(trained_run, tmp_path):
    out = tmp_path / "dataset"
    assert run_cli("record", trained_run, "-o", out, "--episodes", "2", timeout=300).returncode == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert_user_error(run_cli("record", trained_run, "-o", out, "--episodes", "2", timeout=300), "already holds a dataset")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert_user_error(run_cli("record", trained_run, "-o", tmp_path / "x", "--episodes", "0", timeout=120), "--episodes")
    assert_user_error(run_cli("record", tmp_path / "nowhere", "-o", tmp_path / "y", timeout=120), "no such run directory")


@pytest.mark.slow
def test_an_offline_run_trains_on_a_recording(trained_run, tmp_path):
    """`train` with BC reads `record`'s directory (dataset.json beside the Parquet file) through RLlib's Ray Data
    reader and trains on the recorded steps."""
    out = tmp_path / "dataset"
    assert run_cli("record", trained_run, "-o", out, "--episodes", "5", timeout=300).returncode == 0
    recorded = json.loads((out / "dataset.json").read_text())["env_steps"]
    runs = tmp_path / "runs"
    result = run_cli("train", ROOT / "experiments" / "cartpole_bc.yaml", "--runs-dir", runs, "--set", f"data.paths=[{out}]",
                     "--set", "stop.iterations=1", "--set", "data.updates_per_iteration=1", "--set", "evaluation.episodes=1",
                     "--set", f"training.train_batch_size_per_learner={recorded}", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    (metrics,) = read_metrics(only_run_dir(runs, "cartpole-bc"))
    assert metrics["env_steps"] == recorded
    assert np.isfinite(metrics["learner/default_policy/policy_loss"])
