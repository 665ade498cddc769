"""`train` with an offline algorithm (BC, MARWIL, CQL, IQL) and a `data` section.

The quick tests check the refusals, made before Ray starts, through the CLI's own entry point in this process.
The slow ones train through `python -m rlplatform train` on episodes played here by a real env: BC learning
CartPole from an expert, MARWIL from a table of transitions through a column mapping, CQL and IQL a few
iterations on Pendulum.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import ROOT, only_run_dir, read_metrics, run_cli
from episodes import cartpole_expert, play

from rlplatform.adapter import offline_data

BC = str(ROOT / "experiments" / "cartpole_bc.yaml")


@pytest.fixture(scope="module")
def expert_data(tmp_path_factory) -> Path:
    """20 episodes of a CartPole expert (500 steps each), in RLlib's offline format."""
    path = tmp_path_factory.mktemp("expert") / "data"
    offline_data.write_part(play("CartPole-v1", 20, cartpole_expert), path / "episodes-000000.parquet")
    return path


@pytest.fixture(scope="module")
def minari_root(tmp_path_factory) -> Path:
    """Minari's datasets directory holding two datasets made by Minari's own DataCollector: 5 CartPole expert
    episodes (`cartpole/expert-v0`) and 2 Pendulum episodes of random actions (`pendulum/random-v0`)."""
    import gymnasium as gym
    from minari import DataCollector

    root = tmp_path_factory.mktemp("minari")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINARI_DATASETS_PATH", str(root))
        for env_id, dataset_id, count, policy in (("CartPole-v1", "cartpole/expert-v0", 5, cartpole_expert),
                                                  ("Pendulum-v1", "pendulum/random-v0", 2, None)):
            env = DataCollector(gym.make(env_id), record_infos=False)
            env.action_space.seed(0)
            for i in range(count):
                obs, _ = env.reset(seed=i)
                done = False
                while not done:
                    obs, _, terminated, truncated, _ = env.step(env.action_space.sample() if policy is None else policy(obs))
                    done = terminated or truncated
            env.create_dataset(dataset_id=dataset_id, algorithm_name="tests", author="tests", description="tests",
                               author_email="tests@example.invalid", eval_env=env_id)
            env.close()
    return root


@pytest.mark.slow  # no Ray, but Minari's collector (jax) and the conversion take seconds
def test_a_minari_dataset_is_converted_once_to_rllibs_format(minari_root, tmp_path, capsys, monkeypatch):
    import minari
    from ray.rllib.utils.spaces.space_utils import normalize_action

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(minari_root))
    monkeypatch.setenv("RLPLATFORM_CACHE_DIR", str(tmp_path / "cache"))
    config = printed_config(capsys, BC, "--set", "data={minari: cartpole/expert-v0}")
    (converted,) = config["data"]["paths"]
    assert converted.startswith(str(tmp_path / "cache" / "minari"))
    summary = offline_data.summarize(Path(converted))
    assert (summary.episodes, summary.env_steps, summary.return_mean) == (5, 2500, 500.0)
    written = {p: p.stat().st_mtime_ns for p in Path(converted).iterdir()}
    assert printed_config(capsys, BC, "--set", "data={minari: cartpole/expert-v0}")["data"]["paths"] == [converted]
    assert {p: p.stat().st_mtime_ns for p in Path(converted).iterdir()} == written  # not converted again
    # Box actions as RLlib's recordings keep them: in the module's space, [-1, 1] for Pendulum's [-2, 2]
    source = minari.load_dataset("pendulum/random-v0")
    config = printed_config(capsys, BC, "--set", "env=Pendulum-v1", "--set", "data={minari: pendulum/random-v0}")
    episodes = list(offline_data.read_episodes(Path(config["data"]["paths"][0])))
    recorded = next(source.iterate_episodes())
    assert len(episodes) == 2 and len(episodes[0]) == len(recorded.rewards) == 200
    np.testing.assert_allclose(np.asarray(episodes[0].get_actions()),
                               normalize_action(recorded.actions, source.action_space), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(episodes[0].get_observations()), recorded.observations)
    assert "no local Minari dataset 'cartpole/other-v0'" in cli_error(capsys, BC, "--set", "data={minari: cartpole/other-v0}")
    assert "give paths" in cli_error(capsys, BC, "--set", "data={updates_per_iteration: 2}")


def cli_error(capsys, *args: str) -> str:
    """`train ARGS --print-config` in this process: exit code 2 and one line `error: ...`, before Ray starts."""
    import ray

    from rlplatform.cli import main

    code = main(["train", *args, "--print-config"])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), captured
    assert not ray.is_initialized()
    return lines[0]


def printed_config(capsys, *args: str) -> dict:
    from rlplatform.cli import main

    assert main(["train", *args, "--print-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_the_data_paths_are_kept_absolute(expert_data, capsys, monkeypatch):
    monkeypatch.chdir(expert_data.parent)
    config = printed_config(capsys, BC, "--set", "data.paths=[data]")
    assert config["data"]["paths"] == [str(expert_data.resolve())]
    assert config["algorithm"] == "BC"


@pytest.mark.parametrize("overrides, fragment", [
    (["data=null"], "learns from recorded data: give the `data` section"),
    (["algorithm=PPO"], "learns from its env runners, not from a `data` section"),
    (["evaluation.interval=0"], "stop.return_mean without evaluation.interval"),
    (["model.use_lstm=true"], "does not go with model.use_lstm"),
    (["data.columns={obs: o, action: a}"], "'action' is not one of RLlib's columns (did you mean 'actions'?)"),
    (["data.paths=[]"], "data.paths = []: List should have at least 1 item"),
    (["env_config={nope: 1}"], "could not be built here to read its spaces"),
    (["algorithm=CQL", "data.updates_per_iteration=1"], "CQL with the learner in the main process needs data.updates_per_iteration"),
])
def test_offline_settings_that_do_not_go_together_are_refused(expert_data, capsys, overrides, fragment):
    args = [BC, "--set", f"data.paths=[{expert_data}]"]
    for override in overrides:
        args += ["--set", override]
    assert fragment in cli_error(capsys, *args)


def test_data_an_offline_run_cannot_learn_from_is_refused(expert_data, tmp_path, capsys):
    def error(path: Path, *more: str) -> str:
        return cli_error(capsys, BC, "--set", f"data.paths=[{path}]", *more)

    assert "no such dataset" in error(tmp_path / "missing")
    assert "not a path this machine can use" in error(tmp_path / ("x" * 5000))  # the OS refuses the name
    assert "not a path this machine can use" in cli_error(capsys, BC, "--set", 'data.paths=["a\\0b"]')  # a NUL byte
    (tmp_path / "empty").mkdir()
    assert "no Parquet files" in error(tmp_path / "empty")
    (tmp_path / "torn.parquet").write_bytes(b"PAR1 not really")
    assert "not a readable Parquet file" in error(tmp_path / "torn.parquet")
    pq.write_table(pa.table({"item": pa.array([], type=pa.binary())}), tmp_path / "none.parquet")
    assert "holds no rows" in error(tmp_path / "none.parquet")
    pq.write_table(pa.table({"obs": [1.0]}), tmp_path / "table.parquet")
    assert "no column 'item'" in error(tmp_path / "table.parquet") and "data.columns" in error(tmp_path / "table.parquet")
    pq.write_table(pa.table({"item": [1, 2]}), tmp_path / "ints.parquet")
    assert "its first row is not a packed episode" in error(tmp_path / "ints.parquet")
    offline_data.write_part(play("Pendulum-v1", 1), tmp_path / "pendulum" / "p.parquet")
    assert "recorded with observation space Box" in error(tmp_path / "pendulum")
    # the same data, but CQL (Box actions only) on CartPole's Discrete action
    assert "CQL learns a continuous (Box) action" in error(expert_data, "--set", "algorithm=CQL")


def test_a_table_of_transitions_must_hold_the_mapped_columns(tmp_path, capsys):
    table = transitions_table(play("CartPole-v1", 2))
    pq.write_table(table, tmp_path / "t.parquet")
    mapped = "data.columns={obs: observation, new_obs: next_observation, actions: action, terminateds: done}"
    assert "no column 'reward'" in cli_error(capsys, BC, "--set", f"data.paths=[{tmp_path}]", "--set",
                                             mapped.replace("}", ", rewards: reward}"))
    pq.write_table(table.set_column(1, "action", pa.array([[0.5, 0.5]] * table.num_rows)), tmp_path / "t.parquet")
    assert "column 'action'" in cli_error(capsys, BC, "--set", f"data.paths=[{tmp_path}]", "--set", mapped)


def transitions_table(episodes: list) -> pa.Table:
    """The episodes as one row per env step, under column names RLlib does not use (a table from elsewhere)."""
    rows: dict[str, list] = {"observation": [], "action": [], "rewards": [], "next_observation": [], "done": [],
                             "truncateds": [], "eps_id": [], "t": []}
    for episode in episodes:
        obs = np.asarray(episode.get_observations())
        for t in range(len(episode)):
            rows["observation"].append(obs[t].tolist())
            rows["action"].append(int(episode.get_actions(t)))
            rows["rewards"].append(float(episode.get_rewards(t)))
            rows["next_observation"].append(obs[t + 1].tolist())
            last = t == len(episode) - 1
            rows["done"].append(bool(last and episode.is_terminated))
            rows["truncateds"].append(bool(last and episode.is_truncated))
            rows["eps_id"].append(episode.id_)
            rows["t"].append(t)
    return pa.table(rows)


def train(runs: Path, *args: str, timeout: float = 600) -> Path:
    result = run_cli("train", *args, "--runs-dir", runs, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return only_run_dir(runs, yaml.safe_load(Path(args[0]).read_text())["name"])


@pytest.mark.slow
@pytest.mark.learning
def test_bc_learns_cartpole_from_an_expert_recording(expert_data, runs):
    """The preset, on 20 expert episodes: the greedy policy reaches 475 within the iteration cap, evaluated in the
    env; env steps count the recorded steps trained on; the checkpoint's policy is BC's."""
    run = train(runs, BC, "--set", f"data.paths=[{expert_data}]", "--set", "stop.iterations=30")
    metrics = read_metrics(run)
    assert metrics[-1]["eval/return_mean"] >= 475, [m.get("eval/return_mean") for m in metrics]
    batch = 1024 * 10
    assert [m["env_steps"] for m in metrics] == [batch * (i + 1) for i in range(len(metrics))]
    assert all(np.isfinite(m["learner/default_policy/policy_loss"]) for m in metrics)
    assert metrics[-1]["episodes/total"] == 10 * len(metrics)  # the window holds the evaluations' episodes
    manifest = json.loads((run / "manifest.json").read_text())
    assert "lean_env_runner" not in manifest["speedups"]["active"]
    assert list((run / "checkpoints").glob("checkpoint_*"))


@pytest.mark.slow
def test_marwil_learns_from_a_table_through_a_column_mapping(tmp_path, runs):
    pq.write_table(transitions_table(play("CartPole-v1", 10, cartpole_expert)), tmp_path / "table.parquet")
    run = train(runs, BC, "--set", "algorithm=MARWIL", "--set", f"data.paths=[{tmp_path / 'table.parquet'}]",
                "--set", "data.columns={obs: observation, actions: action, new_obs: next_observation, terminateds: done}",
                "--set", "stop.iterations=2", "--set", "data.updates_per_iteration=2", "--set", "stop.return_mean=null")
    metrics = read_metrics(run)
    assert [m["env_steps"] for m in metrics] == [1024 * 2, 1024 * 4]  # 2 train batches of 1,024 per iteration
    assert np.isfinite(metrics[-1]["learner/default_policy/total_loss"])
    assert "eval/return_mean" in metrics[-1]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["CQL", "IQL"])
def test_cql_and_iql_train_on_recorded_pendulum(algorithm, tmp_path, runs):
    offline_data.write_part(play("Pendulum-v1", 5), tmp_path / "pendulum" / "part.parquet")
    experiment = tmp_path / "offline.yaml"
    experiment.write_text(yaml.safe_dump({
        "name": "offline", "algorithm": algorithm, "env": "Pendulum-v1",
        "training": {"train_batch_size_per_learner": 128}, "model": {"hidden": [64, 64]}, "data": {
            "paths": [str(tmp_path / "pendulum")], "updates_per_iteration": 2},
        "evaluation": {"interval": 1, "episodes": 1}, "stop": {"iterations": 3}}))
    metrics = read_metrics(train(runs, str(experiment)))
    assert [m["iteration"] for m in metrics] == [1, 2, 3]
    assert metrics[-1]["env_steps"] == 3 * 2 * 128
    losses = [k for k in metrics[-1] if k.startswith("learner/default_policy/") and "loss" in k]
    assert losses and all(np.isfinite(metrics[-1][k]) for k in losses)
    assert -2000 < metrics[-1]["eval/return_mean"] <= 0


def test_init_from_maps_bcs_tensors_onto_ppos_by_name_and_shape():
    import torch

    from rlplatform.adapter.init_weights import mapped_state

    source = {"_encoder.net.mlp.0.weight": torch.ones(4, 2), "_encoder.net.mlp.0.bias": torch.ones(3),
              "_pi_head.net.mlp.0.weight": torch.full((2, 4), 2.0)}
    target = {"encoder.actor_encoder.net.mlp.0.weight": torch.zeros(4, 2), "encoder.actor_encoder.net.mlp.0.bias": torch.zeros(4),
              "pi.net.mlp.0.weight": torch.zeros(2, 4), "vf.net.mlp.0.weight": torch.zeros(1, 4)}
    state, copied = mapped_state(source, target)
    assert copied == ["encoder.actor_encoder.net.mlp.0.weight", "pi.net.mlp.0.weight"]  # the bias: another shape
    assert torch.equal(state["pi.net.mlp.0.weight"], source["_pi_head.net.mlp.0.weight"])
    assert torch.equal(state["encoder.actor_encoder.net.mlp.0.bias"], torch.zeros(4))
    assert torch.equal(state["vf.net.mlp.0.weight"], torch.zeros(1, 4))


def test_init_from_names_a_run_or_checkpoint_that_exists(tmp_path, capsys):
    assert "no such run directory or checkpoint" in cli_error(capsys, "--set", f"init_from={tmp_path / 'nowhere'}")
    assert "not a path this machine can use" in cli_error(capsys, "--set", f"init_from={tmp_path / ('x' * 5000)}")
    assert "does not go with multi_agent" in cli_error(
        capsys, str(ROOT / "experiments" / "pursuit_ppo.yaml"), "--set", f"init_from={tmp_path}")


@pytest.mark.slow
def test_ppo_starts_from_a_bc_runs_policy(minari_root, runs):
    """init_from: PPO's actor encoder and policy head start as BC's (kept by lr 0 through one iteration), its value
    function fresh; a network of other widths is refused before Ray starts. BC learns from a Minari dataset."""
    from rlplatform.adapter.policy import load_inference_module
    from rlplatform.run.checkpoints import latest_checkpoint

    result = run_cli("train", BC, "--set", "data={minari: cartpole/expert-v0}", "--set", "stop.iterations=1",
                     "--set", "model.hidden=[64, 64]", "--set", "evaluation.episodes=1", "--set", "data.updates_per_iteration=1",
                     "--runs-dir", runs, env={"MINARI_DATASETS_PATH": str(minari_root)})
    assert result.returncode == 0, result.stdout + result.stderr
    bc = only_run_dir(runs, "cartpole-bc")
    assert read_metrics(bc)[-1]["env_steps"] == 1024
    ppo = train(runs, str(ROOT / "experiments" / "cartpole_ppo.yaml"), "--set", f"init_from={bc}", "--set", "training.lr=0.0",
                "--set", "stop.iterations=1", "--set", "stop.return_mean=null", "--set", "scale.env_runners=0")
    manifest = json.loads((ppo / "manifest.json").read_text())
    assert manifest["init_from"]["checkpoint"] == str(latest_checkpoint(bc).path.resolve())
    assert set(manifest["init_from"]["tensors"]) >= {"pi.net.mlp.0.weight", "encoder.actor_encoder.net.mlp.0.weight"}
    source = load_inference_module(latest_checkpoint(bc).path).state_dict()
    started = load_inference_module(latest_checkpoint(ppo).path).state_dict()
    for ours, theirs in (("_pi_head.net.mlp.0.weight", "pi.net.mlp.0.weight"),
                         ("_encoder.net.mlp.2.bias", "encoder.actor_encoder.net.mlp.2.bias")):
        assert np.array_equal(source[ours].numpy(), started[theirs].numpy()), theirs
    assert not any(name.startswith("vf.") for name in manifest["init_from"]["tensors"])
    refused = run_cli("train", str(ROOT / "experiments" / "cartpole_ppo.yaml"), "--set", f"init_from={bc}",
                      "--set", "model.hidden=[32]", "--runs-dir", runs)
    assert refused.returncode == 2 and "model.hidden is [64, 64]" in refused.stderr, refused.stderr


@pytest.mark.slow
def test_sac_starts_from_an_iql_runs_policy(tmp_path, runs):
    """init_from, IQL -> SAC: SAC's policy (its encoder and head) starts as IQL's; actor_lr 0 keeps it through an
    iteration, so the SAC checkpoint holds IQL's policy tensors."""
    from rlplatform.adapter.policy import load_inference_module
    from rlplatform.run.checkpoints import latest_checkpoint

    offline_data.write_part(play("Pendulum-v1", 3), tmp_path / "pendulum" / "part.parquet")
    model = {"hidden": [64, 64], "activation": "relu"}
    iql, sac = tmp_path / "iql.yaml", tmp_path / "sac.yaml"
    iql.write_text(yaml.safe_dump({
        "name": "iql", "algorithm": "IQL", "env": "Pendulum-v1", "model": model, "stop": {"iterations": 1},
        "training": {"train_batch_size_per_learner": 128},
        "data": {"paths": [str(tmp_path / "pendulum")], "updates_per_iteration": 2}}))
    iql_run = train(runs, str(iql))
    sac.write_text(yaml.safe_dump({
        "name": "sac", "algorithm": "SAC", "env": "Pendulum-v1", "model": model, "init_from": str(iql_run),
        "training": {"actor_lr": 0.0, "train_batch_size_per_learner": 32, "num_steps_sampled_before_learning_starts": 64},
        "scale": {"env_runners": 0}, "stop": {"env_steps": 200}}))
    manifest = json.loads((train(runs, str(sac)) / "manifest.json").read_text())
    assert {"pi_encoder.net.mlp.0.weight", "pi.net.mlp.0.weight"} <= set(manifest["init_from"]["tensors"])
    source = load_inference_module(latest_checkpoint(iql_run).path).state_dict()
    started = load_inference_module(latest_checkpoint(only_run_dir(runs, "sac")).path).state_dict()
    for name in ("pi_encoder.net.mlp.0.weight", "pi.net.mlp.0.weight"):
        assert np.array_equal(source[name].numpy(), started[name].numpy()), name
