"""Bad input: exit code 2, one line `error: ...` naming the problem, no traceback, nothing lost.

Each case runs the real CLI in its own process; none of them gets as far as starting Ray.
"""

import hashlib
import json
import os
from pathlib import Path

import pytest
from conftest import ROOT, assert_user_error, run_cli

DEFAULT = ROOT / "experiments" / "cartpole_ppo.yaml"
# Requests one bigger than this machine, whatever its size: a private local instance gets every CPU and GPU.
TOO_MANY_RUNNERS = len(os.sched_getaffinity(0)) + 1  # the main process takes a CPU too


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


GPUS = gpu_count()


def tree_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        digest.update(str(f.relative_to(path)).encode())
        if f.is_file():
            digest.update(f.read_bytes())
    return digest.hexdigest()


@pytest.fixture
def existing_run(runs: Path) -> Path:
    """A run directory written earlier: no bad command may touch it."""
    run_dir = runs / "cartpole-ppo" / "2026-01-01_00-00-00"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(DEFAULT.read_text())
    (run_dir / "metrics.jsonl").write_text('{"iteration": 1}\n')
    return run_dir


def corrupt_checkpoint(run_dir: Path) -> Path:
    """A checkpoint whose marker and layout look complete but whose weights are garbage."""
    ckpt = run_dir / "checkpoints" / "checkpoint_000001"
    module = ckpt / "learner_group" / "learner" / "rl_module" / "default_policy"
    module.mkdir(parents=True)
    (ckpt / "rllib_checkpoint.json").write_text("{}")
    (module / "module_state.pkl").write_bytes(b"not a pickle")
    (module / "class_and_ctor_args.pkl").write_bytes(b"\x80\x04garbage")
    (module / "metadata.json").write_text("{}")
    config = {"name": "cartpole-ppo", "algorithm": "PPO", "env": "CartPole-v1"}
    (ckpt / "rlplatform_checkpoint.json").write_text(json.dumps({"iteration": 1, "env_steps": 10, "config": config}))
    return ckpt


CASES = {
    "unknown key with suggestion": (["--set", "scale.env_runner=2"], ["unknown key 'scale.env_runner'", "env_runners"]),
    "wrong type": (["--set", "scale.env_runners=many"], ["scale.env_runners", "'many'"]),
    "out of range": (["--set", "scale.envs_per_runner=0"], ["scale.envs_per_runner", "0"]),
    "unknown algorithm": (["--set", "algorithm=PPPO"], ["unknown algorithm 'PPPO'", "PPO"]),
    "unknown env id": (["--set", "env=CartPol-v1"], ["unknown env id 'CartPol-v1'", "CartPole-v1"]),
    "unknown hyper-parameter": (["--set", "training.lrr=0.1"], ["training.lrr", "'lr'"]),
    "hyper-parameter of the wrong type": (["--set", "training.num_epochs=ten"], ["training.num_epochs = 'ten'", "an integer"]),
    "float for an integer hyper-parameter": (["--set", "training.minibatch_size=64.5"], ["training.minibatch_size", "an integer"]),
    "integer for a bool hyper-parameter": (["--set", "training.use_gae=1"], ["training.use_gae = 1", "true or false"]),
    "text for a float hyper-parameter (alias)": (["--set", "training.lambda=high"], ["training.lambda = 'high'", "a number"]),
    "APPO minibatches with an automatic fragment": (["--set", "algorithm=APPO", "--set", "training.minibatch_size=128"],
                                                   ["training.minibatch_size", "scale.rollout_fragment_length"]),
    "unknown rllib pass-through": (["--set", "rllib.env_runner={num_env_runners: 1}"], ["rllib.env_runner", "env_runners"]),
    "more GPUs than exist": (["--set", "hardware.gpus_per_learner=1"] if GPUS == 0 else  # the learner in the main process
                             ["--set", f"scale.learners={GPUS + 1}", "--set", "hardware.gpus_per_learner=1"],
                             [f"needs {GPUS + 1} GPUs", f"cluster has {GPUS}"]),
    "more CPUs than exist": (["--set", f"scale.env_runners={TOO_MANY_RUNNERS}", "--profile", "laptop"],
                             [f"needs {TOO_MANY_RUNNERS + 1} CPUs", f"{TOO_MANY_RUNNERS} actors x 1"]),
    "bad --set": (["--set", "training.lr"], ["bad --set", "KEY=VALUE"]),
    "bad --set value": (["--set", "training.lr=[1"], ["bad --set", "YAML"]),
    "unknown profile": (["--profile", "supercomputer"], ["unknown profile 'supercomputer'", "laptop"]),
    "missing experiment file": (["experiments/nope.yaml"], ["not found", "nope.yaml"]),
}


# Cases whose process imports RLlib to check them (about 4 s each on 2 cores): slow, but for one of them.
SLOW_CASES = {"unknown env id", "hyper-parameter of the wrong type", "float for an integer hyper-parameter",
              "integer for a bool hyper-parameter", "text for a float hyper-parameter (alias)",
              "APPO minibatches with an automatic fragment", "unknown rllib pass-through", "more GPUs than exist",
              "more CPUs than exist"}


@pytest.mark.parametrize("args,fragments", [pytest.param(*case, marks=[pytest.mark.slow] if name in SLOW_CASES else [])
                                            for name, case in CASES.items()], ids=list(CASES))
def test_bad_train_input(args, fragments, runs, existing_run):
    before = tree_digest(runs)
    assert_user_error(run_cli("train", *args, "--runs-dir", runs), *fragments)
    assert tree_digest(runs) == before


def test_malformed_yaml_names_file_and_line(tmp_path, runs, existing_run):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: PPO\ntraining:\n  lr: [0.1\n")
    before = tree_digest(runs)
    assert_user_error(run_cli("train", bad, "--runs-dir", runs), "malformed YAML", "bad.yaml", "line")
    assert tree_digest(runs) == before


def test_unknown_top_level_key_in_file(tmp_path, runs):
    bad = tmp_path / "typo.yaml"
    bad.write_text("algorithm: PPO\ntrainig:\n  lr: 0.1\n")
    assert_user_error(run_cli("train", bad, "--runs-dir", runs), "unknown key 'trainig'", "'training'")


def test_unwritable_output_directory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert_user_error(run_cli("train", "--runs-dir", blocker / "runs"), "not writable", str(blocker / "runs"))


def test_resume_missing_run_dir(tmp_path):
    assert_user_error(run_cli("train", "--resume", tmp_path / "no-such-run"), "not found", "no-such-run")


@pytest.mark.slow  # its process imports RLlib (about 4 s on 2 cores)
def test_resume_without_checkpoint(runs, existing_run):
    before = tree_digest(runs)
    assert_user_error(run_cli("train", "--resume", existing_run), "no complete checkpoint")
    assert tree_digest(runs) == before


@pytest.mark.slow  # its process imports RLlib (about 4 s on 2 cores)
def test_resume_corrupt_checkpoint(runs, existing_run):
    corrupt_checkpoint(existing_run)
    before = tree_digest(runs)
    assert_user_error(run_cli("train", "--resume", existing_run), "cannot be loaded", "checkpoint_000001")
    assert tree_digest(runs) == before


def test_evaluate_missing_checkpoint(tmp_path):
    assert_user_error(run_cli("evaluate", tmp_path / "gone"), "no such run directory or checkpoint")


@pytest.mark.slow  # its process imports RLlib (about 4 s on 2 cores)
def test_evaluate_corrupt_checkpoint(runs, existing_run):
    ckpt = corrupt_checkpoint(existing_run)
    assert_user_error(run_cli("evaluate", ckpt, "--episodes", "1"), "cannot be loaded")


def test_unknown_verb_and_flag():
    assert_user_error(run_cli("trian"), "invalid choice")
    assert_user_error(run_cli("train", "--nope"), "--nope")


def test_training_types_come_from_rllibs_defaults():
    """The type check reads RLlib's config class: what it takes stays accepted (schedules, ints for floats, None)."""
    from rlplatform.adapter.algorithm_config import training_type_problem

    schedule = [[0, 0.01], [1000, 0.0]]
    accepted = [("PPO", "entropy_coeff", schedule), ("PPO", "lr", schedule), ("APPO", "entropy_coeff", schedule),
                ("PPO", "lr", 1), ("PPO", "grad_clip", None), ("PPO", "num_epochs", 3), ("PPO", "use_gae", False),
                ("IMPALA", "learner_queue_timeout", 12.5),  # an int default, annotated float
                ("DQN", "epsilon", [[0, 1.0], [1000, 0.05]]), ("PPO", "grad_clip_by", "value")]
    for algorithm, key, value in accepted:
        assert training_type_problem(algorithm, key, value) is None, (algorithm, key, value)
    refused = [("PPO", "num_epochs", "ten"), ("PPO", "num_epochs", 2.0), ("PPO", "num_epochs", True),
               ("PPO", "clip_param", schedule), ("PPO", "use_gae", "yes"), ("SAC", "tau", "0.005"),
               ("PPO", "grad_clip_by", 1)]
    for algorithm, key, value in refused:
        assert training_type_problem(algorithm, key, value), (algorithm, key, value)
