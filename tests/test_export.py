"""`export` to ONNX and TorchScript, proved by round trips against the RLlib module it came from.

Each algorithm and model kind trains for one real iteration (the round trip is about equality, not
skill; one run per kind, shared by the module's tests). Then, on 1,000 observations sampled from the
observation space, the exported model's actions equal what `evaluate` does with the checkpoint (RLlib's
greedy action as the env gets it): exactly for discrete actions, to 1e-5 for continuous ones; and
greedy episodes with the same seeds give the same returns.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, assert_user_error, only_run_dir, run_cli

ONE_ITERATION = ["--set", "stop.iterations=1", "--set", "stop.env_steps=null", "--set", "stop.return_mean=null",
                 "--set", "scale.env_runners=0", "--set", "rllib.reporting.min_time_s_per_iteration=0"]
SMALL_PPO = ["--set", "training.train_batch_size_per_learner=128", "--set", "training.minibatch_size=64"]
# name -> train arguments. Together: every algorithm, MLP / CNN / LSTM models, the three action
# distributions (categorical, Gaussian, squashed Gaussian), DQN's argmax of Q, two policies in one run,
# and float64 observations (MuJoCo's).
CASES = {
    "ppo-mlp": ["--set", "model.hidden=[32]", *SMALL_PPO],
    "ppo-lstm": ["--set", "model={hidden: [16], use_lstm: true, lstm_cell_size: 16, max_seq_len: 10}", *SMALL_PPO],
    "appo-gaussian": ["--set", "algorithm=APPO", "--set", "env=Pendulum-v1", "--set", "training={}", "--set", "model.hidden=[32]"],
    "impala-cnn": ["--set", "algorithm=IMPALA", "--set", "training={}", "--set", "env=rlplatform/PixelCatch-v0",
                   "--set", "env_config={size: 16, frame_stack: 2, paddle_width: 4}",
                   "--set", "model={conv_filters: [[8, [4, 4], 2], [16, [4, 4], 2]], hidden: [32]}"],
    "sac": ["--set", "algorithm=SAC", "--set", "env=HalfCheetah-v5", "--set", "model.hidden=[32]",  # float64 observations
            "--set", "training={num_steps_sampled_before_learning_starts: 100}"],
    # bounds of +-2: the squashed mean mapped to a Box that is not [-1, 1]
    "sac-pendulum": ["--set", "algorithm=SAC", "--set", "env=Pendulum-v1", "--set", "model.hidden=[32]",
                     "--set", "training={num_steps_sampled_before_learning_starts: 100}"],
    "dqn": ["--set", "algorithm=DQN", "--set", "model.hidden=[32]",
            "--set", "training={num_steps_sampled_before_learning_starts: 100}",
            "--set", "rllib.reporting.min_sample_timesteps_per_iteration=100"],
    "multi-agent": [ROOT / "experiments" / "pursuit_ppo.yaml", "--set", "model.hidden=[16]",
                    "--set", "multi_agent.policies.evader.model.hidden=[8]", *SMALL_PPO],
}
CONTINUOUS = {"appo-gaussian", "sac", "sac-pendulum"}
# MuJoCo's dynamics grow the runtimes' 1e-7 differences in an action into percents of an episode's return within 100
# steps: there the export is compared with the checkpoint on every observation of the checkpoint's greedy episode.
CHAOTIC = {"sac"}


class Recording:
    """A policy that keeps every observation it is asked to act on."""

    def __init__(self, policy) -> None:
        self.policy, self.observations = policy, []

    def initial_state(self):
        return self.policy.initial_state()

    def act(self, observations, state=None):
        self.observations.append(np.asarray(observations))
        return self.policy.act(observations, state)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Each case's run directory, trained once on first use."""
    runs = tmp_path_factory.mktemp("export-runs")
    done: dict[str, Path] = {}

    def run_dir(case: str) -> Path:
        if case not in done:
            result = run_cli("train", "--runs-dir", runs, "--set", f"name={case}", *ONE_ITERATION, *CASES[case], timeout=300)
            assert result.returncode == 0, result.stdout + result.stderr
            done[case] = only_run_dir(runs, case)
        return done[case]

    return run_dir


def _checkpoint_and_config(run_dir: Path):
    from rlplatform.commands.evaluate import find_checkpoint
    from rlplatform.config.schema import validate

    info = find_checkpoint(run_dir, "latest")
    return info, validate(info.meta["config"])


def _observations(space, n: int = 1000) -> np.ndarray:
    space.seed(0)
    return np.stack([space.sample() for _ in range(n)])


def _assert_same_actions(got: np.ndarray, expected: np.ndarray, continuous: bool) -> None:
    assert got.shape == expected.shape, (got.shape, expected.shape)
    if continuous:
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    else:
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, expected)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_round_trip(case, trained, tmp_path):
    """Both formats: the same actions on 1,000 sampled observations; the same greedy episodes (ONNX; and
    TorchScript for the recurrent policy, whose state the episode threads through the model)."""
    from rlplatform.adapter.export import reference_actions
    from rlplatform.adapter.policy import load_inference_module
    from rlplatform.commands.evaluate import CheckpointPolicy, evaluate, run_episodes, run_multi_agent_episodes
    from rlplatform.export.runtime import ExportedPolicy
    from rlplatform.export.writer import export_checkpoint

    info, config = _checkpoint_and_config(trained(case))
    episodes = 1 if case in CONTINUOUS else 3  # a Pendulum episode is 200 steps
    expected = evaluate(info.path, config, episodes, seed=7, video_dir=None)
    for fmt in ("onnx", "torchscript"):
        spec = export_checkpoint(info, config, fmt, tmp_path / fmt)
        policies = {}
        for name, described in spec["policies"].items():
            module = load_inference_module(info.path, name if config.multi_agent else None)
            policy = policies[name] = ExportedPolicy(tmp_path / fmt / described["file"], described)
            obs = _observations(module.observation_space)
            actions, _ = policy.act(obs, policy.initial_state(len(obs)))
            _assert_same_actions(actions, reference_actions(module, config, obs), case in CONTINUOUS)
            if case in CONTINUOUS:  # mapped to the env's Box, never outside it
                low, high = module.action_space.low, module.action_space.high
                assert np.all(actions >= low) and np.all(actions <= high), (actions.min(), actions.max())
            if case == "sac-pendulum":
                space = described["action_space"]
                assert (space["low"], space["high"], list(module.action_space.high)) == (-2.0, 2.0, [2.0]), space
                assert np.abs(actions).max() > 1.0  # the actions use the Box beyond [-1, 1]: the mapping is exercised
        if fmt == "torchscript" and case != "ppo-lstm":
            continue
        if config.multi_agent:
            assert sorted(p["file"] for p in spec["policies"].values()) == [f"evader{spec_suffix(fmt)}", f"pursuer{spec_suffix(fmt)}"]
            got = run_multi_agent_episodes(policies, config.multi_agent.mapping, config.env, config.env_config, episodes, 7)
        elif case in CHAOTIC:
            (policy,) = policies.values()
            module = load_inference_module(info.path, None)
            recording = Recording(CheckpointPolicy(module, config))
            run_episodes(recording, config.env, config.env_config, episodes, 7, None, name=case)
            visited = np.concatenate(recording.observations)
            actions, _ = policy.act(visited, policy.initial_state(len(visited)))
            _assert_same_actions(actions, reference_actions(module, config, visited), continuous=True)
            continue
        else:
            (policy,) = policies.values()
            got = run_episodes(policy, config.env, config.env_config, episodes, 7, None, name=case)
        assert got["lengths"] == expected["lengths"], fmt
        np.testing.assert_allclose(got["returns"], expected["returns"], rtol=1e-4 if case in CONTINUOUS else 0)
    if case == "ppo-lstm":
        assert [i["name"] for i in spec["policies"]["default_policy"]["inputs"]][0] == "obs"
        assert {i["name"] for i in spec["policies"]["default_policy"]["outputs"]} >= {"action", "state_out.actor.h"}


def spec_suffix(fmt: str) -> str:
    return ".onnx" if fmt == "onnx" else ".pt"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ppo-mlp", "sac"])
def test_stochastic_export_samples_the_policy_distribution(case, trained, tmp_path):
    """--stochastic: with the noise drawn as export.json says, the actions follow RLlib's own action distribution."""
    import torch
    from ray.rllib.core.columns import Columns

    from rlplatform.adapter.export import InferencePolicy
    from rlplatform.adapter.policy import as_module_input, load_inference_module, to_env_action
    from rlplatform.export.runtime import ExportedPolicy
    from rlplatform.export.writer import export_checkpoint

    info, config = _checkpoint_and_config(trained(case))
    spec = export_checkpoint(info, config, "onnx", tmp_path, stochastic=True)
    described = spec["policies"]["default_policy"]
    assert [i["name"] for i in described["inputs"]] == ["obs", "noise"]
    module = load_inference_module(info.path)
    obs = np.repeat(_observations(module.observation_space, 1), 4000, axis=0)
    got, _ = ExportedPolicy(tmp_path / described["file"], described, seed=1).act(obs)
    torch.manual_seed(0)
    with torch.no_grad():
        logits = module.forward_inference({Columns.OBS: as_module_input(torch.as_tensor(obs))})[Columns.ACTION_DIST_INPUTS]
        samples = module.get_exploration_action_dist_cls().from_logits(logits).sample().numpy()
    reference = np.stack([np.asarray(to_env_action(a, module.action_space, config)) for a in samples])
    if case == "sac":
        assert described["noise"] == "normal(0,1)"
        for q in (0.1, 0.5, 0.9):  # the same distribution: quantiles agree to sampling error
            assert abs(np.quantile(got, q) - np.quantile(reference, q)) < 0.1, q
    else:
        assert described["noise"] == "uniform(0,1)"
        expected = torch.softmax(logits[0], -1).numpy()
        frequencies = np.bincount(got, minlength=len(expected)) / len(got)
        np.testing.assert_allclose(frequencies, expected, atol=0.03)
        np.testing.assert_allclose(np.bincount(reference, minlength=len(expected)) / len(got), expected, atol=0.03)
    assert InferencePolicy(module, config, stochastic=True).signature().noise == described["noise"]


NO_RAY = """
import sys
from rlplatform.cli import main
code = main(sys.argv[1:])
loaded = sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'torch'})
print('imported:', loaded)
sys.exit(code or (3 if 'ray' in loaded else 0))
"""


@pytest.mark.slow
def test_cli_export_then_evaluate_with_onnxruntime_alone(trained, tmp_path):
    """`export` then `evaluate DIR`: no Ray, no RLlib, no torch in the evaluating process; same returns as the checkpoint."""
    run_dir = trained("ppo-mlp")
    out = tmp_path / "exported"
    result = run_cli("export", run_dir, "-o", out)
    assert result.returncode == 0, result.stdout + result.stderr
    spec = json.loads((out / "export.json").read_text())
    assert spec["algorithm"] == "PPO" and spec["format"] == "onnx" and spec["env"] == "CartPole-v1"
    assert spec["versions"]["onnxruntime"] and spec["versions"]["ray"] == "2.60.0"
    assert Path(spec["source"]["checkpoint"]).parent == run_dir / "checkpoints"
    assert spec["policies"]["default_policy"]["observation_space"]["low"][1] == "-inf"
    import onnx

    onnx.checker.check_model(onnx.load(str(out / "policy.onnx")), full_check=True)

    evaluated = subprocess.run([sys.executable, "-c", NO_RAY, "evaluate", str(out), "--episodes", "5", "--seed", "3",
                                "--json", str(tmp_path / "onnx.json"), "--video", str(tmp_path / "videos")],
                               capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    assert "imported: []" in evaluated.stdout
    assert len(list((tmp_path / "videos").glob("*.mp4"))) == 5
    from rlplatform.commands.evaluate import evaluate

    info, config = _checkpoint_and_config(run_dir)
    exported = json.loads((tmp_path / "onnx.json").read_text())
    assert exported["returns"] == evaluate(info.path, config, 5, seed=3, video_dir=None)["returns"]

    bare = subprocess.run([sys.executable, "-c", NO_RAY, "evaluate", str(out / "policy.onnx"), "--env", "CartPole-v1",
                           "--episodes", "5", "--seed", "3", "--json", str(tmp_path / "bare.json")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bare.returncode == 0, bare.stdout + bare.stderr
    assert json.loads((tmp_path / "bare.json").read_text())["returns"] == exported["returns"]


@pytest.mark.slow
def test_dqn_stochastic_is_refused_in_one_line(trained, tmp_path, capsys):
    from rlplatform.cli import main

    assert main(["export", str(trained("dqn")), "-o", str(tmp_path / "out"), "--stochastic"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: --stochastic: a DQN policy is the argmax of Q") and "\n" not in error, error


def test_bad_export_input_is_one_line(tmp_path):
    assert_user_error(run_cli("export", tmp_path / "missing", "-o", tmp_path / "out"), "no such run directory")
    assert_user_error(run_cli("export", tmp_path, "-o", tmp_path / "out", "--format", "tflite"), "--format")
    model = tmp_path / "policy.onnx"
    model.write_bytes(b"not a model")
    assert_user_error(run_cli("evaluate", model), "--env")
    assert_user_error(run_cli("evaluate", model, "--env", "CartPole-v1"), "onnxruntime cannot load it")
    (tmp_path / "export.json").write_text("{}")
    assert_user_error(run_cli("evaluate", tmp_path), "not an rlplatform export description")
