"""RLlib 2.60's other new-stack algorithms behind the same schema: TQC and DreamerV3 train a few iterations
through `python -m rlplatform train` (real Ray, real envs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import only_run_dir, read_metrics, run_cli


def train(tmp_path: Path, experiment: dict) -> list[dict]:
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump({"name": "x", **experiment}))
    result = run_cli("train", path, "--runs-dir", tmp_path / "runs", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return read_metrics(only_run_dir(tmp_path / "runs", "x"))


@pytest.mark.slow
def test_tqc_trains_pendulum(tmp_path):
    metrics = train(tmp_path, {
        "algorithm": "TQC", "env": "Pendulum-v1", "model": {"hidden": [64, 64]}, "scale": {"env_runners": 0},
        "training": {"train_batch_size_per_learner": 64, "num_steps_sampled_before_learning_starts": 200, "n_quantiles": 10},
        "stop": {"iterations": 3}})
    assert [m["iteration"] for m in metrics] == [1, 2, 3] and metrics[-1]["env_steps"] > 200
    losses = {k: v for k, v in metrics[-1].items() if k.startswith("learner/default_policy/") and "loss" in k}
    assert losses and all(np.isfinite(v) for v in losses.values()), metrics[-1]


@pytest.mark.slow
def test_dreamerv3_trains_cartpole(tmp_path):
    metrics = train(tmp_path, {
        "algorithm": "DreamerV3", "env": "CartPole-v1", "scale": {"env_runners": 0, "envs_per_runner": 1},
        "training": {"model_size": "XS", "training_ratio": 64, "batch_size_B": 4, "batch_length_T": 16},
        "stop": {"iterations": 2}})
    assert [m["iteration"] for m in metrics] == [1, 2] and metrics[-1]["env_steps"] > metrics[0]["env_steps"] > 0
    assert any(k.startswith("learner/default_policy/") for k in metrics[-1]), metrics[-1]
